// Writes into and copies within the paged KV cache (layout: kv_cache_layout.h).
//
// Both ops move whole head_dim rows or whole blocks of one dtype, so they
// copy bytes and need no float dispatch.
#include <cstring>

#include "ops/kv_cache_layout.h"
#include "ops/op_contracts.h"
#include "ops/ops.h"
#include "ops/parallel.h"

namespace pagedserve::ops {
void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping) {
  check_reshape_and_cache(Device::kCPU, key, value, key_cache, value_cache, slot_mapping);
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
  check_copy_blocks(Device::kCPU, kv_cache, block_copies);
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
