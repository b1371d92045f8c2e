// Small pieces shared by the attention kernels.
#pragma once

#include <cmath>

namespace pagedserve::cuda {

// Scores are kept in the log2 domain (score * scale * log2(e)) so the softmax
// uses exp2, one MUFU op.
inline constexpr float kLog2e = 1.4426950408889634f;

// q.k -> the log2-domain score: q.k * scale * log2(e), or with soft-capping c
// (Gemma 2) c * tanh(q.k * scale / c) * log2(e). tanhf, not tanh.approx: its
// 2^-11 relative error, times c ~ 50, would move probabilities by percents.
// A runtime flag, not a template argument: every kernel branches once per
// tile on it (uniformly), and the instantiations stay as many as before.
struct ScoreMap {
  float scale_log2;  // scale * log2(e)
  float cap_inner;   // scale / c
  float cap_outer;   // c * log2(e)
  bool capped;

  __host__ __device__ static ScoreMap make(float scale, float softcap) {
    return softcap > 0.f ? ScoreMap{scale * kLog2e, scale / softcap, softcap * kLog2e, true}
                         : ScoreMap{scale * kLog2e, 0.f, 0.f, false};
  }
  __device__ __forceinline__ float capped_score(float dot) const { return cap_outer * tanhf(dot * cap_inner); }
};

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

// x - max, which stays -inf (its exponent 0, not NaN) while a row has seen no key (max = -inf).
__device__ __forceinline__ float shifted(float x, float max) { return x - (max == -INFINITY ? 0.f : max); }

// exp2(x - max), 0 while a row has seen no key.
__device__ __forceinline__ float exp2_shifted(float x, float max) { return exp2f(shifted(x, max)); }

// 1 / l for the final O / l, as the approximate reciprocal (rcp.approx, ~1 ulp):
// cuDNN normalizes this way, and matching it keeps the outputs bit-identical
// (bench/numerics/softmax_numerics.py). 0 for l = 0, a row that saw no key (bad lengths).
__device__ __forceinline__ float approx_reciprocal_or_zero(float l) { return l > 0.f ? __fdividef(1.f, l) : 0.f; }

// The first position a decode row (query at seq_len - 1) sees under a window
// span (INT_MAX: none); its partitions cover [decode_begin, seq_len).
__device__ __forceinline__ int decode_begin(int seq_len, int window_span) {
  return seq_len > window_span ? seq_len - window_span : 0;
}

// Partitions of a decode row that hold keys: its visible context
// [decode_begin, seq_len) cut into partition_tokens. Both decode kernels use
// this one formula, so they agree on which rows the reduction must finish.
// Clamped to the grid: a seq_len above the host max_seq_len bound is a caller
// error that must not read past the workspace.
__device__ __forceinline__ int live_partitions(int seq_len, int window_span, int partition_tokens,
                                               int num_partitions) {
  const int visible = seq_len - decode_begin(seq_len, window_span);
  if (visible <= 0) return 0;
  return min((visible + partition_tokens - 1) / partition_tokens, num_partitions);
}

}  // namespace pagedserve::cuda
