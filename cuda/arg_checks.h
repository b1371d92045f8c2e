// Argument checks shared by the CUDA ops (each op adds its own shape rules).
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "ops/tensor_view.h"

namespace pagedserve::cuda {

// A contiguous CUDA tensor with ndim dims.
inline void require_cuda_tensor(std::string_view op, std::string_view arg, const ops::TensorView& t, int ndim) {
  ops::require_device(op, arg, t, ops::Device::kCUDA);
  ops::require_ndim(op, arg, t, ndim);
  ops::require_contiguous(op, arg, t);
}

inline void require_cuda_float(std::string_view op, std::string_view arg, const ops::TensorView& t, int ndim) {
  require_cuda_tensor(op, arg, t, ndim);
  ops::require_float(op, arg, t);
}

inline void require_cuda_int32(std::string_view op, std::string_view arg, const ops::TensorView& t, int ndim) {
  require_cuda_tensor(op, arg, t, ndim);
  ops::require_dtype(op, arg, t, ops::DType::kInt32);
}

// All of an op's tensors must live on the device of the first one.
inline void require_same_device(std::string_view op, std::string_view arg, const ops::TensorView& t,
                                const ops::TensorView& like) {
  PS_REQUIRE(t.device_index == like.device_index, op,
               std::string(arg) + " is on cuda:" + std::to_string(t.device_index) + " but the other tensors are on cuda:" +
                   std::to_string(like.device_index));
}

// Launch shapes are int: refuse sizes that would overflow them.
inline int checked_int(std::string_view op, std::string_view what, int64_t value) {
  PS_REQUIRE(value >= 0 && value <= std::numeric_limits<int32_t>::max(), op,
               std::string(what) + " = " + std::to_string(value) + " does not fit the kernels' int32 indexing");
  return static_cast<int>(value);
}

// Vectorized kernels need 16-byte aligned base pointers.
inline bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace pagedserve::cuda
