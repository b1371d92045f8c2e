// The dot products of one warp in the small-batch kernels (small_batch_linear.cu,
// qkv_linear_rope_cache.cu): a row of W (two for a gated or rotation pair)
// against each of the few rows of x.
//
// Each lane streams 16-byte pieces of the row, so a warp's loads cover 512
// contiguous bytes per step, dots them with every row of x (a few KiB, served
// from L1), and the warp sums its lanes with a fixed shuffle tree. Float32
// products and sums in an order that depends on K only, never on the number
// of rows or columns: a row's result is the same in any batch.
#pragma once

#include <string>
#include <string_view>

#include "float_convert.cuh"
#include "launch_limits.h"

namespace pagedserve::cuda::small_batch {

constexpr int kLanes = 32;

// The lanes load 16-byte pieces: K a multiple of 16 / sizeof(T), x and weight 16-byte aligned.
template <typename T>
void require_vector_operands(std::string_view op, const TensorView& x, const TensorView& weight) {
  PS_REQUIRE(x.size(1) % kVec16<T> == 0 && is_aligned16(x.data) && is_aligned16(weight.data), op,
             "x and weight need K a multiple of " + std::to_string(kVec16<T>) + " and 16-byte alignment, got " +
                 x.describe() + " and " + weight.describe());
}

// acc[m] += dot(w[k0, k0 + V), x[m][k0, k0 + V)) for one lane's piece.
template <typename T, int kRows, int kVec>
__device__ __forceinline__ void dot_piece(float (&acc)[kRows], const float (&w)[kVec], const T* x, int k0,
                                          int k_size) {
#pragma unroll
  for (int m = 0; m < kRows; ++m) {
    float xv[kVec];
    load_as_float(xv, x + m * k_size + k0);
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[m] = __fmaf_rn(w[e], xv[e], acc[m]);
  }
}

template <int kRows>
__device__ __forceinline__ void warp_sum(float (&acc)[kRows]) {
#pragma unroll
  for (int m = 0; m < kRows; ++m) {
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset /= 2) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], offset);
  }
}

// acc[m] = dot(row, x[m]) and, kTwo, acc2[m] = dot(row2, x[m]), in every lane.
template <typename T, int kRows, bool kTwo>
__device__ __forceinline__ void warp_dot(float (&acc)[kRows], float (&acc2)[kRows], const T* row, const T* row2,
                                         const T* x, int k_size, int lane) {
  constexpr int kVec = kVec16<T>;
  // Eight pieces in flight per lane keep the loads ahead of memory latency (K = 2048 is 8 pieces: the
  // whole row at once). ptxas (CUDA 13, sm_90) spilled a few bytes at unroll 1, 2 and 4 in some of the
  // 48 instantiations, none at 8 (at most 146 registers, 8 rows and two W rows).
#pragma unroll 8
  for (int k0 = lane * kVec; k0 < k_size; k0 += kLanes * kVec) {
    float w[kVec];
    load_as_float(w, row + k0);
    dot_piece<T, kRows, kVec>(acc, w, x, k0, k_size);
    if constexpr (kTwo) {
      float w2[kVec];
      load_as_float(w2, row2 + k0);
      dot_piece<T, kRows, kVec>(acc2, w2, x, k0, k_size);
    }
  }
  warp_sum(acc);
  if constexpr (kTwo) warp_sum(acc2);
}

// acc[m] in lane m (lanes past kRows: 0): registers cannot be indexed at run time.
template <int kRows>
__device__ __forceinline__ float row_of_lane(const float (&acc)[kRows], int lane) {
  float value = 0.f;
#pragma unroll
  for (int m = 0; m < kRows; ++m) {
    if (m == lane) value = acc[m];
  }
  return value;
}

}  // namespace pagedserve::cuda::small_batch
