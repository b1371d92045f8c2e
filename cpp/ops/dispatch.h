// The one place a float DType becomes a C++ storage type.
//
// Each op calls dispatch_float exactly once, with a templated lambda holding
// its kernel:  dispatch_float(x.dtype, "rms_norm", [&]<typename T>() { ... });
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

#include "float_types.h"
#include "tensor_view.h"

namespace pagedserve::ops {

[[noreturn]] inline void fail_not_float(std::string_view op, DType dtype) {
  throw std::invalid_argument(std::string(op) + ": expected a float32, float16 or bfloat16 tensor, got " +
                              std::string(dtype_name(dtype)));
}

template <typename Fn>
decltype(auto) dispatch_float(DType dtype, std::string_view op, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32:
      return fn.template operator()<float>();
    case DType::kFloat16:
      return fn.template operator()<Half>();
    case DType::kBFloat16:
      return fn.template operator()<BFloat16>();
    default:
      fail_not_float(op, dtype);
  }
}

}  // namespace pagedserve::ops
