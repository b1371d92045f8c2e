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

// The hardware exp2 (ex2.approx.ftz), as FlashAttention-2 and cuDNN use it for
// the softmax of 16-bit attention: the same instruction rounds P the same way.
__device__ __forceinline__ float fast_exp2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

// Partitions of a decode row that hold keys. Both decode kernels use this one
// formula, so they agree on which rows the reduction must finish. Clamped to
// the grid: a seq_len above the host max_seq_len bound is a caller error that
// must not read past the workspace.
__device__ __forceinline__ int live_partitions(int seq_len, int partition_tokens, int num_partitions) {
  if (seq_len <= 0) return 0;
  return min((seq_len + partition_tokens - 1) / partition_tokens, num_partitions);
}

}  // namespace pagedserve::cuda
