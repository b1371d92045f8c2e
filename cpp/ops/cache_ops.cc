// Writes into and copies within the paged KV cache (layout: kv_cache_layout.h).
//
// Both ops move whole head_dim rows or whole blocks of one dtype, so they
// copy bytes and need no float dispatch.
#include <cstring>
#include <string>

#include "ops/kv_cache_layout.h"
#include "ops/op_checks.h"
#include "ops/ops.h"
#include "ops/parallel.h"

namespace pagedserve::ops {
namespace {

void check_reshape_and_cache_args(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                                  const TensorView& value_cache, const TensorView& slot_mapping) {
  constexpr std::string_view op = "reshape_and_cache";
  require_cpu_float(op, "key", key, 3);
  require_cpu_float(op, "value", value, 3);
  require_cpu_float(op, "key_cache", key_cache, 4);
  require_cpu_float(op, "value_cache", value_cache, 4);
  require_cpu_int32(op, "slot_mapping", slot_mapping, 1);
  require_same_dtype(op, "value", value, key);
  require_same_dtype(op, "key_cache", key_cache, key);
  require_same_dtype(op, "value_cache", value_cache, key);
  const int64_t tokens = key.size(0);
  for (int dim = 0; dim < 3; ++dim) require_size(op, "value", value, dim, key.size(dim));
  for (int dim = 0; dim < 4; ++dim) require_size(op, "value_cache", value_cache, dim, key_cache.size(dim));
  require_size(op, "key_cache", key_cache, 1, key.size(1));
  require_size(op, "key_cache", key_cache, 3, key.size(2));
  require_size(op, "slot_mapping", slot_mapping, 0, tokens);

  const int64_t num_slots = key_cache.size(0) * key_cache.size(2);
  const int32_t* slots = slot_mapping.ptr<int32_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    PS_REQUIRE(slots[t] == kPadSlot || (slots[t] >= 0 && slots[t] < num_slots), op,
            "slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slots[t]) + " is outside the cache [0, " +
                std::to_string(num_slots) + ") and is not kPadSlot (-1)");
  }
}

void check_copy_blocks_args(const TensorView& kv_cache, const TensorView& block_copies) {
  constexpr std::string_view op = "copy_blocks";
  require_cpu_float(op, "kv_cache", kv_cache, 6);
  require_cpu_int32(op, "block_copies", block_copies, 2);
  require_size(op, "kv_cache", kv_cache, 1, 2);
  require_size(op, "block_copies", block_copies, 1, 2);
  const int64_t num_blocks = kv_cache.size(2);
  const int32_t* ids = block_copies.ptr<int32_t>();
  for (int64_t i = 0; i < 2 * block_copies.size(0); ++i) {
    PS_REQUIRE(ids[i] >= 0 && ids[i] < num_blocks, op,
            "block_copies[" + std::to_string(i / 2) + "][" + std::to_string(i % 2) + "] = " + std::to_string(ids[i]) +
                " is not a block id in [0, " + std::to_string(num_blocks) + ")");
  }
}

}  // namespace

void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping) {
  check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping);
  const int64_t tokens = key.size(0);
  const int64_t kv_heads = key.size(1);
  const int64_t head_dim = key.size(2);
  const int64_t block_size = key_cache.size(2);
  const int64_t element_bytes = element_size(key.dtype);
  const auto row_bytes = static_cast<size_t>(head_dim * element_bytes);
  const auto* key_bytes = static_cast<const char*>(key.data);
  const auto* value_bytes = static_cast<const char*>(value.data);
  auto* key_cache_bytes = static_cast<char*>(key_cache.data);
  auto* value_cache_bytes = static_cast<char*>(value_cache.data);
  const int32_t* slots = slot_mapping.ptr<int32_t>();

  parallel_for_range(tokens, 2 * kv_heads * head_dim, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] == kPadSlot) continue;
      const int64_t block = slots[t] / block_size;
      const int64_t offset = slots[t] % block_size;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const auto src = static_cast<size_t>(t * kv_heads + h) * row_bytes;
        const auto dst =
            static_cast<size_t>(kv_cache_offset(block, h, offset, kv_heads, block_size, head_dim) * element_bytes);
        std::memcpy(key_cache_bytes + dst, key_bytes + src, row_bytes);
        std::memcpy(value_cache_bytes + dst, value_bytes + src, row_bytes);
      }
    }
  });
}

void copy_blocks(const TensorView& kv_cache, const TensorView& block_copies) {
  check_copy_blocks_args(kv_cache, block_copies);
  const int64_t num_copies = block_copies.size(0);
  // Every (layer, keys-or-values) plane is independent; within one, copies run
  // in the given order because a later copy may read an earlier one's dst.
  const int64_t num_planes = kv_cache.size(0) * 2;
  const int64_t num_blocks = kv_cache.size(2);
  const auto block_bytes =
      static_cast<size_t>(kv_cache.size(3) * kv_cache.size(4) * kv_cache.size(5) * element_size(kv_cache.dtype));
  auto* cache_bytes = static_cast<char*>(kv_cache.data);
  const int32_t* ids = block_copies.ptr<int32_t>();

  parallel_for_range(num_planes, num_copies * static_cast<int64_t>(block_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t plane = begin; plane < end; ++plane) {
      char* plane_bytes = cache_bytes + static_cast<size_t>(plane * num_blocks) * block_bytes;
      for (int64_t c = 0; c < num_copies; ++c) {
        const auto src = static_cast<size_t>(ids[2 * c]);
        const auto dst = static_cast<size_t>(ids[2 * c + 1]);
        if (src != dst) std::memcpy(plane_bytes + dst * block_bytes, plane_bytes + src * block_bytes, block_bytes);
      }
    }
  });
}

}  // namespace pagedserve::ops
