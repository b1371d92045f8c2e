// Host stand-in for cuda/dependent_launch.cuh (same interface): the emulator
// runs launches one after another, so there is nothing to overlap or wait for.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace pagedserve::cuda {

inline void wait_for_previous_kernel() {}
inline void let_next_kernel_launch() {}

template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t /*stream*/,
                      const char* /*kernel_name*/, Args&&... args) {
  emu::launch(grid, block, shared_bytes, [&] { kernel(args...); });
}

}  // namespace pagedserve::cuda
