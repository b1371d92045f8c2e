// The arithmetic of a half rotation (NeoX / Llama / Qwen rope), shared by
// rotary_embedding (in place, rotary_kernel.cu) and qkv_rope_cache (from the
// qkv projection into the query tensor or the KV cache, qkv_rope_cache.cu),
// so the two round identically.
#pragma once

#include "float_convert.cuh"

namespace pagedserve::cuda {

// dst[i..i+V), dst[half+i..) = the rotation of src's pair x1 = src[i..], x2 =
// src[half+i..] by cos[i..], sin[i..] (float32). HF's rounding in the model
// dtype (see cpp/ops/rotary.cc): cos, sin, each product and the sum rounded to
// T. dst may be src: every load happens before the stores.
template <typename T, int kVec>
__device__ __forceinline__ void rotate_pair(T* dst, const T* src, const float* cos, const float* sin, int half, int i) {
  float x1[kVec], x2[kVec], c[kVec], s[kVec], out1[kVec], out2[kVec];
  load_as_float(x1, src + i);
  load_as_float(x2, src + half + i);
  load_as_float(c, cos + i);
  load_as_float(s, sin + i);
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    const float ce = round_through<T>(c[e]), se = round_through<T>(s[e]);
    out1[e] = round_through<T>(x1[e] * ce) - round_through<T>(x2[e] * se);
    out2[e] = round_through<T>(x2[e] * ce) + round_through<T>(x1[e] * se);
  }
  store_from_float(dst + i, out1);
  store_from_float(dst + half + i, out2);
}

}  // namespace pagedserve::cuda
