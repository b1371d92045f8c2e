// Limits of the CUDA kernels themselves, checked after an op's argument
// contract (cpp/ops/op_contracts.h), which CPU and CUDA ops share.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "ops/tensor_view.h"

namespace pagedserve::cuda {

// Launch shapes are int: refuse sizes that would overflow them.
inline int checked_int(std::string_view op, std::string_view what, int64_t value) {
  PS_REQUIRE(value >= 0 && value <= std::numeric_limits<int32_t>::max(), op,
             std::string(what) + " = " + std::to_string(value) + " does not fit the kernels' int32 indexing");
  return static_cast<int>(value);
}

// Vectorized kernels need 16-byte aligned base pointers.
inline bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace pagedserve::cuda
