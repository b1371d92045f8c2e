// Writes into and copies within the paged KV cache (layout: kv_cache_layout.h).
//
// Both ops move whole head_dim rows or whole blocks, so where the cache has
// the inputs' dtype they copy bytes and need no float dispatch. The one
// conversion: float32 keys and values into a bf16 cache (a bf16 KV cache on
// the CPU), rounded to nearest even as the rows are written.
#include <cstring>

#include "ops/cpu_isa.h"
#include "ops/float_types.h"
#include "ops/kv_cache_layout.h"
#include "ops/op_contracts.h"
#include "ops/ops.h"
#include "ops/parallel.h"

namespace pagedserve::ops {
namespace {

// Copies one head_dim row into the cache: bytes, or float32 rounded to bf16.
template <bool kToBf16>
PS_ALWAYS_INLINE void store_row(char* dst, const char* src, int64_t head_dim, size_t row_bytes) {
  if constexpr (kToBf16) {
    const auto* in = reinterpret_cast<const float*>(src);
    auto* out = reinterpret_cast<BFloat16*>(dst);
    for (int64_t d = 0; d < head_dim; ++d) out[d] = float_to_bf16(in[d]);
  } else {
    std::memcpy(dst, src, row_bytes);
  }
}

}  // namespace

void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping) {
  check_reshape_and_cache(Device::kCPU, key, value, key_cache, value_cache, slot_mapping);
  const int64_t tokens = key.size(0);
  const int64_t kv_heads = key.size(1);
  const int64_t head_dim = key.size(2);
  const int64_t block_size = key_cache.size(2);
  const int64_t in_bytes = element_size(key.dtype);
  const int64_t cache_bytes = element_size(key_cache.dtype);
  const auto row_bytes = static_cast<size_t>(head_dim * in_bytes);
  const auto* key_bytes = static_cast<const char*>(key.data);
  const auto* value_bytes = static_cast<const char*>(value.data);
  auto* key_cache_bytes = static_cast<char*>(key_cache.data);
  auto* value_cache_bytes = static_cast<char*>(value_cache.data);
  const int32_t* slots = slot_mapping.ptr<int32_t>();

  const auto write_rows = [&]<bool kToBf16>(int64_t begin, int64_t end) PS_INLINE_BODY {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] == kPadSlot) continue;
      const int64_t block = slots[t] / block_size;
      const int64_t offset = slots[t] % block_size;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const auto src = static_cast<size_t>(t * kv_heads + h) * row_bytes;
        const auto dst =
            static_cast<size_t>(kv_cache_offset(block, h, offset, kv_heads, block_size, head_dim) * cache_bytes);
        store_row<kToBf16>(key_cache_bytes + dst, key_bytes + src, head_dim, row_bytes);
        store_row<kToBf16>(value_cache_bytes + dst, value_bytes + src, head_dim, row_bytes);
      }
    }
  };
  const bool to_bf16 = key_cache.dtype != key.dtype;  // the contract admits only float32 -> bf16
  parallel_for_range(tokens, 2 * kv_heads * head_dim, [&](int64_t begin, int64_t end) {
    if (to_bf16) {
      with_cpu_isa([&]() PS_INLINE_BODY { write_rows.template operator()<true>(begin, end); });
    } else {
      write_rows.template operator()<false>(begin, end);
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
