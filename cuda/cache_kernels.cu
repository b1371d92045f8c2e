// KV-cache writers: reshape_and_cache (new tokens into their slots) and
// copy_blocks (copy-on-write block copies), layout in cpp/ops/kv_cache_layout.h.
//
// reshape_and_cache: one block per token; its threads copy the token's
// Hkv * D keys and values in 16-byte vectors. A token's key is contiguous in
// the input, and each head's D elements are contiguous in the cache tile, so
// both sides are coalesced. Bytes: 2 * T * Hkv * D elements read and written.
//
// copy_blocks: one block per (copy, layer * {K, V}); a (block) slab of
// Hkv * B * D elements is contiguous, copied with 16-byte words.
// Bytes: 2 * L * C * Hkv * B * D elements read and written.
#include <algorithm>

#include "cuda_check.h"
#include "cuda_ops.h"
#include "dispatch.h"
#include "float_convert.cuh"
#include "kv_cache_index.cuh"
#include "launch_limits.h"
#include "ops/op_contracts.h"

namespace pagedserve::cuda {
namespace {

constexpr int kBlockThreads = 256;

struct CacheShape {
  int num_kv_heads;
  int head_dim;
  int block_size;
  int64_t num_slots;  // num_blocks * block_size
};

template <typename T, int kVec>
__global__ void __launch_bounds__(kBlockThreads)
    reshape_and_cache_kernel(const T* key, const T* value, T* key_cache, T* value_cache, const int32_t* slot_mapping,
                             CacheShape shape) {
  const int token = static_cast<int>(blockIdx.x);
  const int64_t slot = slot_mapping[token];
  if (slot < 0 || slot >= shape.num_slots) return;  // kPadSlot, or a slot past the cache
  const int64_t block = slot / shape.block_size;
  const int offset = static_cast<int>(slot % shape.block_size);
  const int vecs_per_head = shape.head_dim / kVec;
  const int num_vecs = shape.num_kv_heads * vecs_per_head;
  const int64_t token_base = static_cast<int64_t>(token) * shape.num_kv_heads * shape.head_dim;
  for (int v = static_cast<int>(threadIdx.x); v < num_vecs; v += static_cast<int>(blockDim.x)) {
    const int head = v / vecs_per_head;
    const int col = v % vecs_per_head * kVec;
    const int64_t src = token_base + static_cast<int64_t>(head) * shape.head_dim + col;
    const int64_t dst = cache_row_offset(block, head, offset, shape.num_kv_heads, shape.block_size, shape.head_dim) + col;
    *reinterpret_cast<Vec<T, kVec>*>(key_cache + dst) = *reinterpret_cast<const Vec<T, kVec>*>(key + src);
    *reinterpret_cast<Vec<T, kVec>*>(value_cache + dst) = *reinterpret_cast<const Vec<T, kVec>*>(value + src);
  }
}

// Word: uint4 (16 bytes) when the slab allows it, else uint16_t (every dtype is a multiple of 2 bytes).
template <typename Word>
__global__ void __launch_bounds__(kBlockThreads)
    copy_blocks_kernel(Word* kv_cache, const int32_t* block_copies, int num_blocks, int64_t words_per_block) {
  const int copy = static_cast<int>(blockIdx.x);
  const int src = block_copies[2 * copy];
  const int dst = block_copies[2 * copy + 1];
  if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks) return;
  Word* cache = kv_cache + static_cast<int64_t>(blockIdx.y) * num_blocks * words_per_block;  // one layer's K or V
  const Word* from = cache + src * words_per_block;
  Word* to = cache + dst * words_per_block;
  for (int64_t w = threadIdx.x; w < words_per_block; w += blockDim.x) to[w] = from[w];
}

}  // namespace

void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping, cudaStream_t stream) {
  constexpr const char* kOp = "reshape_and_cache";
  ops::check_reshape_and_cache(ops::Device::kCUDA, key, value, key_cache, value_cache, slot_mapping);
  const int64_t num_tokens = key.size(0);
  const CacheShape shape{checked_int(kOp, "kv heads", key.size(1)), checked_int(kOp, "head_dim", key.size(2)),
                         checked_int(kOp, "block_size", key_cache.size(2)), key_cache.size(0) * key_cache.size(2)};
  const int grid = checked_int(kOp, "num_tokens", num_tokens);
  if (grid == 0 || key.numel() == 0) return;
  DeviceGuard guard(key.device_index);
  dispatch_float(key.dtype, kOp, [&]<typename T>() {
    const bool vectorized = shape.head_dim % kVec16<T> == 0 && is_aligned16(key.data) && is_aligned16(value.data) &&
                            is_aligned16(key_cache.data) && is_aligned16(value_cache.data);
    dispatch_vector_width<T>(vectorized, [&]<int kVec>() {
      const int num_vecs = shape.num_kv_heads * shape.head_dim / kVec;
      const int block = std::min(kBlockThreads, ceil_div(num_vecs, 32) * 32);
      reshape_and_cache_kernel<T, kVec><<<grid, block, 0, stream>>>(key.ptr<const T>(), value.ptr<const T>(),
                                                                    key_cache.ptr<T>(), value_cache.ptr<T>(),
                                                                    slot_mapping.ptr<const int32_t>(), shape);
      check_launch("reshape_and_cache_kernel");
    });
  });
}

void copy_blocks(const TensorView& kv_cache, const TensorView& block_copies, cudaStream_t stream) {
  constexpr const char* kOp = "copy_blocks";
  ops::check_copy_blocks(ops::Device::kCUDA, kv_cache, block_copies);
  const int num_copies = checked_int(kOp, "number of copies", block_copies.size(0));
  const int num_layer_slabs = checked_int(kOp, "layers * 2", kv_cache.size(0) * 2);
  PS_REQUIRE(num_layer_slabs <= 65535, kOp, "at most 32767 layers");
  const int num_blocks = checked_int(kOp, "num_blocks", kv_cache.size(2));
  const int64_t block_bytes = kv_cache.size(3) * kv_cache.size(4) * kv_cache.size(5) * ops::element_size(kv_cache.dtype);
  if (num_copies == 0 || num_layer_slabs == 0 || block_bytes == 0) return;
  DeviceGuard guard(kv_cache.device_index);
  const dim3 grid(static_cast<unsigned>(num_copies), static_cast<unsigned>(num_layer_slabs));
  if (block_bytes % 16 == 0 && is_aligned16(kv_cache.data)) {
    copy_blocks_kernel<uint4><<<grid, kBlockThreads, 0, stream>>>(kv_cache.ptr<uint4>(), block_copies.ptr<const int32_t>(),
                                                                   num_blocks, block_bytes / 16);
  } else {
    copy_blocks_kernel<uint16_t><<<grid, kBlockThreads, 0, stream>>>(
        kv_cache.ptr<uint16_t>(), block_copies.ptr<const int32_t>(), num_blocks, block_bytes / 2);
  }
  check_launch("copy_blocks_kernel");
}

}  // namespace pagedserve::cuda
