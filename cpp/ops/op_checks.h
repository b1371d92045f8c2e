// Argument checks shared by the CPU ops (each op adds its own shape rules).
#pragma once

#include <string_view>

#include "ops/tensor_view.h"

namespace pagedserve::ops {

// A contiguous CPU tensor with ndim dims.
inline void require_cpu_tensor(std::string_view op, std::string_view arg, const TensorView& t, int ndim) {
  require_device(op, arg, t, Device::kCPU);
  require_ndim(op, arg, t, ndim);
  require_contiguous(op, arg, t);
}

// A contiguous CPU float tensor with ndim dims.
inline void require_cpu_float(std::string_view op, std::string_view arg, const TensorView& t, int ndim) {
  require_cpu_tensor(op, arg, t, ndim);
  require_float(op, arg, t);
}

// A contiguous CPU int32 tensor with ndim dims.
inline void require_cpu_int32(std::string_view op, std::string_view arg, const TensorView& t, int ndim) {
  require_cpu_tensor(op, arg, t, ndim);
  require_dtype(op, arg, t, DType::kInt32);
}

}  // namespace pagedserve::ops
