// Shared-memory tiles of 16-bit values for the tensor-core attention kernels,
// and the cp.async loaders that fill them (queries, and keys / values gathered
// through a block table).
//
// A tile is kRows x D values, row-major, each row cut into 16-byte chunks of
// 8 values. Chunk c of row r is stored at chunk c ^ (r % 8): the 8 row
// addresses of one ldmatrix then fall in 8 distinct 16-byte bank groups, so
// both ldmatrix and ldmatrix.trans are conflict free.
#pragma once

#include <cstdint>

#include "kv_cache_index.cuh"
#include "mma.cuh"

namespace pagedserve::cuda {

template <int kHeadDim>
struct SwizzledTile {
  static constexpr int kChunksPerRow = kHeadDim / 8;
  static_assert(kChunksPerRow % 8 == 0, "the swizzle needs rows of a multiple of 8 chunks (head_dim % 64 == 0)");

  // Element offset of chunk `chunk` of row `row`.
  __device__ static __forceinline__ int offset(int row, int chunk) {
    return row * kHeadDim + ((chunk ^ (row & 7)) * 8);
  }
};

// Rows [0, num_valid) of src (row r at src + r * row_stride) into a tile;
// later rows are zero-filled. src must point at a readable row.
template <typename T, int kHeadDim, int kRows, int kThreads>
__device__ __forceinline__ void load_rows_async(T* tile, const T* src, int64_t row_stride, int num_valid, int tid) {
  using Tile = SwizzledTile<kHeadDim>;
  constexpr int kChunks = kRows * Tile::kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int k = 0; k < kChunks / kThreads; ++k) {
    const int i = tid + k * kThreads;
    const int row = i / Tile::kChunksPerRow;
    const int chunk = i % Tile::kChunksPerRow;
    const bool valid = row < num_valid;
    const T* from = valid ? src + row * row_stride + chunk * 8 : src;
    cp_async_16(tile + Tile::offset(row, chunk), from, valid);
  }
}

// Keys and values of tokens [first, first + kRows) of one kv head, gathered
// through block_table into two tiles. Tokens at or past `end` are zero-filled
// and their block table entries never read, so masked scores meet zero values
// (0 * 0, never 0 * NaN from stale shared memory).
template <typename T, int kHeadDim, int kBlockSize, int kRows, int kThreads>
__device__ __forceinline__ void load_kv_tiles_async(T* key_tile, T* value_tile, const T* key_cache,
                                                    const T* value_cache, const int32_t* block_table, int first,
                                                    int end, int kv_head, int num_kv_heads, int tid) {
  using Tile = SwizzledTile<kHeadDim>;
  constexpr int kChunks = kRows * Tile::kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int k = 0; k < kChunks / kThreads; ++k) {
    const int i = tid + k * kThreads;
    const int row = i / Tile::kChunksPerRow;
    const int chunk = i % Tile::kChunksPerRow;
    const int token = first + row;
    const bool valid = token < end;
    int64_t offset = 0;
    if (valid) {
      const int32_t block = block_table[token / kBlockSize];
      offset = cache_row_offset(block, kv_head, token % kBlockSize, num_kv_heads, kBlockSize, kHeadDim) + chunk * 8;
    }
    const int dst = Tile::offset(row, chunk);
    cp_async_16(key_tile + dst, key_cache + offset, valid);
    cp_async_16(value_tile + dst, value_cache + offset, valid);
  }
}

}  // namespace pagedserve::cuda
