// The per-head RMSNorm of queries and keys that some models apply between
// the qkv projection and rope (Qwen3, Gemma 3, OLMoE: transformers' q_norm
// and k_norm over head_dim), as an optional part of qkv_rope_cache: each q
// and k head of D values is normalized as rms_norm normalizes a row of D
// (its eps, and its rounding: the normalized value rounded to the dtype, then
// times the weight, rounded again), then rotated.
#pragma once

#include "ops/tensor_view.h"

namespace pagedserve::ops {

struct QkNorm {
  TensorView q_weight;  // [D] of qkv's dtype; no data: no norm (then k_weight has none either)
  TensorView k_weight;  // [D]
  float eps = 0.0f;

  bool applies() const { return q_weight.data != nullptr || k_weight.data != nullptr; }
};

}  // namespace pagedserve::ops
