// Device twin of kv_cache_offset() in cpp/ops/kv_cache_layout.h, the one
// definition of the cache layout (that function is host-only).
#pragma once

#include <cstdint>

namespace pagedserve::cuda {

// Element offset of (block, kv_head, offset_in_block, 0) in one layer's K or V
// cache [num_blocks, num_kv_heads, block_size, head_dim].
__device__ __forceinline__ int64_t cache_row_offset(int64_t block, int kv_head, int offset_in_block, int num_kv_heads,
                                                    int block_size, int head_dim) {
  return ((block * num_kv_heads + kv_head) * block_size + offset_in_block) * static_cast<int64_t>(head_dim);
}

}  // namespace pagedserve::cuda
