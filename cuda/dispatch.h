// The one place runtime shapes and dtypes become template arguments.
//
// Each op's launcher calls one dispatcher with a templated lambda:
//   dispatch_attention(q.dtype, head_dim, block_size, "paged_attention",
//                      [&]<typename T, int kHeadDim, int kBlockSize>() { ... });
// An unsupported value throws std::invalid_argument listing what is compiled.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <string>
#include <string_view>

#include "ops/tensor_view.h"

namespace pagedserve::cuda {

[[noreturn]] inline void fail_unsupported(std::string_view op, std::string_view what, const std::string& got,
                                          std::string_view supported) {
  throw std::invalid_argument(std::string(op) + ": unsupported " + std::string(what) + " " + got + " (compiled for " +
                              std::string(supported) + ")");
}

// float32 -> float, float16 -> __half, bfloat16 -> __nv_bfloat16.
template <typename Fn>
decltype(auto) dispatch_float(ops::DType dtype, std::string_view op, Fn&& fn) {
  switch (dtype) {
    case ops::DType::kFloat32:
      return fn.template operator()<float>();
    case ops::DType::kFloat16:
      return fn.template operator()<__half>();
    case ops::DType::kBFloat16:
      return fn.template operator()<__nv_bfloat16>();
    default:
      fail_unsupported(op, "dtype", std::string(ops::dtype_name(dtype)), "float32, float16, bfloat16");
  }
}

// Head dims the attention kernels are compiled for.
template <typename Fn>
decltype(auto) dispatch_head_dim(int head_dim, std::string_view op, Fn&& fn) {
  switch (head_dim) {
    case 64:
      return fn.template operator()<64>();
    case 128:
      return fn.template operator()<128>();
    default:
      fail_unsupported(op, "head_dim", std::to_string(head_dim), "64, 128");
  }
}

// KV-cache block sizes the attention kernels are compiled for.
template <typename Fn>
decltype(auto) dispatch_block_size(int block_size, std::string_view op, Fn&& fn) {
  switch (block_size) {
    case 16:
      return fn.template operator()<16>();
    case 32:
      return fn.template operator()<32>();
    default:
      fail_unsupported(op, "block_size", std::to_string(block_size), "16, 32");
  }
}

// Every attention configuration: dtype x head dim x block size.
template <typename Fn>
decltype(auto) dispatch_attention(ops::DType dtype, int head_dim, int block_size, std::string_view op, Fn&& fn) {
  return dispatch_float(dtype, op, [&]<typename T>() -> decltype(auto) {
    return dispatch_head_dim(head_dim, op, [&]<int kHeadDim>() -> decltype(auto) {
      return dispatch_block_size(block_size, op, [&]<int kBlockSize>() -> decltype(auto) {
        return fn.template operator()<T, kHeadDim, kBlockSize>();
      });
    });
  });
}

// Row counts small_batch_linear is compiled for: 1..kMaxSmallBatchRows (ops/op_contracts.h).
template <typename Fn>
decltype(auto) dispatch_small_rows(int rows, std::string_view op, Fn&& fn) {
  switch (rows) {
    case 1: return fn.template operator()<1>();
    case 2: return fn.template operator()<2>();
    case 3: return fn.template operator()<3>();
    case 4: return fn.template operator()<4>();
    case 5: return fn.template operator()<5>();
    case 6: return fn.template operator()<6>();
    case 7: return fn.template operator()<7>();
    case 8: return fn.template operator()<8>();
    default: fail_unsupported(op, "row count", std::to_string(rows), "1..8");
  }
}

// Elementwise kernels: 16-byte vectors when `vectorized`, else one element at a time.
template <typename T, typename Fn>
decltype(auto) dispatch_vector_width(bool vectorized, Fn&& fn) {
  if (vectorized) return fn.template operator()<static_cast<int>(16 / sizeof(T))>();
  return fn.template operator()<1>();
}

}  // namespace pagedserve::cuda
