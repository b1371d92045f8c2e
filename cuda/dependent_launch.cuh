// Programmatic dependent launch (PDL, sm_90): a kernel's launch overlaps the
// tail of the kernel before it on the stream.
//
// Why: a decode step at batch 1 is ~180 kernels of 2-10 us each (TinyLlama
// shape, H200). Between two kernels in a CUDA graph the GPU idles ~1.4 us
// (1.24 ms of graph time for 0.98 ms of kernel time) while the next grid is
// launched and its first loads travel to memory. With PDL the next grid's
// CTAs start as soon as every CTA of the current one has passed
// let_next_kernel_launch(), run their prologue (a matrix product issues its
// first weight loads: weights never depend on the previous kernel), and block
// in wait_for_previous_kernel() until the previous grid has finished and its
// writes are visible.
//
// The contract for a kernel launched with launch_dependent:
//  - every CTA calls wait_for_previous_kernel() before it reads anything a
//    dependent-launched kernel may have written or writes global memory (and
//    before returning early: a grid that finishes without waiting would let
//    the kernel after it run ahead of the one before). Before the wait it may
//    read what only ordinary launches and the host write, such as weights: a
//    writer like that lets its successor start only when it is done, and a
//    dependent kernel lets its own start only after its wait, so every such
//    write before this kernel is complete (rms_norm_torch_order_kernel loads
//    its weights there);
//  - it calls let_next_kernel_launch() after that wait, so at most one grid
//    is launched ahead of the one running.
// Results are bit-identical with PDL on or off; PAGEDSERVE_PDL=0 turns it off
// (for before/after timings). Inside CUDA graph capture the dependency
// becomes a programmatic edge; before sm_90 the device calls are no-ops and
// the launch attribute is not set.
#pragma once

#include <cuda_runtime.h>

#include "cuda_check.h"
#include "device_features.h"

namespace pagedserve::cuda {

__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void let_next_kernel_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether launches on the current device may overlap their predecessor:
// compute capability 9.0 or newer, and PAGEDSERVE_PDL is not "0". Cached per device.
inline bool dependent_launch_enabled() {
  static const bool allowed = env_switch_on("PAGEDSERVE_PDL");
  return allowed && current_compute_capability() >= 90;
}

// kernel<<<grid, block, shared_bytes, stream>>>(args...), allowed to start
// while the previous kernel on `stream` finishes (see the contract above).
template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                      const char* kernel_name, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  if (dependent_launch_enabled()) {
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  check_cuda(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), kernel_name);
}

}  // namespace pagedserve::cuda
