// The arithmetic of a half rotation (NeoX / Llama / Qwen rope), shared by
// rotary_embedding (in place, rotary_kernel.cu) and qkv_rope_cache (from the
// qkv projection into the query tensor or the KV cache, qkv_rope_cache.cu),
// so the two round identically.
#pragma once

#include "float_convert.cuh"

namespace pagedserve::cuda {

// The rotation of one pair (x1, x2) by (c, s), before the final rounding to T
// (the caller's store does it). HF's rounding in the model dtype (see
// cpp/ops/rotary.cc): cos, sin and each product rounded to T.
template <typename T>
__device__ __forceinline__ void rotate_values(float x1, float x2, float c, float s, float& out1, float& out2) {
  const float ce = round_through<T>(c), se = round_through<T>(s);
  out1 = round_through<T>(x1 * ce) - round_through<T>(x2 * se);
  out2 = round_through<T>(x2 * ce) + round_through<T>(x1 * se);
}

// dst[i..i+V), dst[half+i..) = the rotation of src's pair x1 = src[i..], x2 =
// src[half+i..] by cos[i..], sin[i..] (float32), as rotate_values; the sums
// round to T as they are stored. dst may be src: every load happens before the
// stores.
template <typename T, int kVec>
__device__ __forceinline__ void rotate_pair(T* dst, const T* src, const float* cos, const float* sin, int half, int i) {
  float x1[kVec], x2[kVec], c[kVec], s[kVec], out1[kVec], out2[kVec];
  load_as_float(x1, src + i);
  load_as_float(x2, src + half + i);
  load_as_float(c, cos + i);
  load_as_float(s, sin + i);
#pragma unroll
  for (int e = 0; e < kVec; ++e) rotate_values<T>(x1[e], x2[e], c[e], s[e], out1[e], out2[e]);
  store_from_float(dst + i, out1);
  store_from_float(dst + half + i, out2);
}

}  // namespace pagedserve::cuda
