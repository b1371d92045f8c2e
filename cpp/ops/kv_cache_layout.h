// The KV-cache layout, the one place it is defined. CPU ops, CUDA kernels and
// the Python runner (pagedserve/kv_cache.py) all follow it.
//
// The runner allocates ONE tensor for the whole model:
//
//     kv_cache: [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]
//                            ^ 0 = keys, 1 = values
//
// in the model's dtype (float32, float16 or bfloat16), contiguous. Layer l's
// key cache is kv_cache[l, 0] and its value cache kv_cache[l, 1], each
//
//     [num_blocks, num_kv_heads, block_size, head_dim]   ("HND" per block)
//
// so one (block, kv head) tile of block_size x head_dim elements is contiguous:
// a decode kernel reads a whole tile with coalesced 16-byte loads.
//
// A token at position p of a sequence lives in slot
//     slot = block_table[p / block_size] * block_size + p % block_size,
// i.e. block = slot / block_size, offset = slot % block_size, and its key for
// kv head h is key_cache[block][h][offset][0:head_dim].
//
// Slot mappings use kPadSlot for padded tokens (CUDA-graph padding): writers
// skip them. Block tables are padded with kPadBlock (step_output.h); readers
// never look past a sequence's length.
#pragma once

#include <cstdint>

namespace pagedserve {

inline constexpr int32_t kPadSlot = -1;

// Element offset of (block, kv_head, offset, 0) inside one layer's key or value cache.
inline int64_t kv_cache_offset(int64_t block, int64_t kv_head, int64_t offset, int64_t num_kv_heads,
                               int64_t block_size, int64_t head_dim) {
  return ((block * num_kv_heads + kv_head) * block_size + offset) * head_dim;
}

}  // namespace pagedserve
