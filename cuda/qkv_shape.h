// The head layout the attention-input kernels (qkv_rope_cache.cu,
// qkv_linear_rope_cache.cu) work with, read off their tensors once.
#pragma once

#include <cstdint>
#include <string_view>

#include "launch_limits.h"
#include "ops/tensor_view.h"

namespace pagedserve::cuda {

struct QkvShape {
  int num_query_heads;
  int num_kv_heads;
  int head_dim;
  int rotary_dim;    // R: the leading dims of a q or k head that rotate, in pairs (i, R / 2 + i)
  int max_position;  // rows of the cos/sin table
  int block_size;
  int64_t num_slots;  // blocks * block_size: a slot at or past it writes no KV

  // From query_out [T, Hq, D], key_cache [N, Hkv, B, D] and cos_sin [max_position, R].
  static QkvShape of(std::string_view op, const TensorView& query_out, const TensorView& key_cache,
                     const TensorView& cos_sin) {
    return {checked_int(op, "query heads", query_out.size(1)), checked_int(op, "kv heads", key_cache.size(1)),
            checked_int(op, "head_dim", query_out.size(2)),    checked_int(op, "rotary dim", cos_sin.size(1)),
            checked_int(op, "max_position", cos_sin.size(0)), checked_int(op, "block_size", key_cache.size(2)),
            key_cache.size(0) * key_cache.size(2)};
  }
};

}  // namespace pagedserve::cuda
