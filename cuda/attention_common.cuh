// Small pieces shared by the attention kernels.
#pragma once

#include <cmath>

namespace pagedserve::cuda {

// Scores are kept in the log2 domain (score * scale * log2(e)) so the softmax
// uses exp2, one MUFU op.
inline constexpr float kLog2e = 1.4426950408889634f;

// Reductions over the 4 lanes of an mma quad (the lanes sharing a C row).
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// exp2(x - max) that stays 0 (not NaN) while a row has seen no key (max = -inf).
__device__ __forceinline__ float exp2_shifted(float x, float max) { return exp2f(x - (max == -INFINITY ? 0.f : max)); }

// 1 / l for the final O / l, as the approximate reciprocal (rcp.approx, ~1 ulp):
// cuDNN normalizes this way, and matching it keeps the outputs bit-identical
// (bench/numerics/softmax_numerics.py). 0 for l = 0, a row that saw no key (bad lengths).
__device__ __forceinline__ float approx_reciprocal_or_zero(float l) { return l > 0.f ? __fdividef(1.f, l) : 0.f; }

// Partitions of a decode row that hold keys. Both decode kernels use this one
// formula, so they agree on which rows the reduction must finish. Clamped to
// the grid: a seq_len above the host max_seq_len bound is a caller error that
// must not read past the workspace.
__device__ __forceinline__ int live_partitions(int seq_len, int partition_tokens, int num_partitions) {
  if (seq_len <= 0) return 0;
  return min((seq_len + partition_tokens - 1) / partition_tokens, num_partitions);
}

}  // namespace pagedserve::cuda
