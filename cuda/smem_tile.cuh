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

  // Where thread `tid` of kThreads copying a tile chunk by chunk in row-major
  // order (chunk tid + k * kThreads in step k) puts step k's chunk. Where a
  // step moves down a multiple of 8 rows the swizzle is the same in every
  // step: the offset is one register plus a constant, where offset() per step
  // gave ptxas one register per step to hold across a kernel's key loop.
  template <int kThreads>
  __device__ static __forceinline__ int copy_offset(int tid, int k) {
    if constexpr (kThreads % (8 * kChunksPerRow) == 0) {
      return offset(tid / kChunksPerRow, tid % kChunksPerRow) + k * kThreads * 8;
    } else {
      const int i = tid + k * kThreads;
      return offset(i / kChunksPerRow, i % kChunksPerRow);
    }
  }
};

// The layout wgmma reads (128-byte swizzle, wgmma.cuh): kRows x D values as
// D / 64 slabs of kRows x 64 values, one after another; inside a slab, row r's
// 128 bytes hold its chunk c at chunk c ^ (r % 8), SwizzledTile's XOR. The
// tile must start 1,024-byte aligned (the hardware swizzles address bits).
template <int kHeadDim, int kRows>
struct SlabTile {
  static constexpr int kChunksPerRow = kHeadDim / 8;
  static constexpr int kSlabElems = kRows * 64;
  static_assert(kHeadDim % 64 == 0 && kRows % 8 == 0, "whole slabs of whole swizzle atoms");

  __device__ static __forceinline__ int offset(int row, int chunk) {
    return (chunk / 8) * kSlabElems + row * 64 + ((chunk % 8) ^ (row & 7)) * 8;
  }
  // As SwizzledTile::copy_offset: a step moves down kThreads / kChunksPerRow rows.
  template <int kThreads>
  __device__ static __forceinline__ int copy_offset(int tid, int k) {
    if constexpr (kThreads % (8 * kChunksPerRow) == 0) {
      return offset(tid / kChunksPerRow, tid % kChunksPerRow) + k * (kThreads / kChunksPerRow) * 64;
    } else {
      const int i = tid + k * kThreads;
      return offset(i / kChunksPerRow, i % kChunksPerRow);
    }
  }
};

// The offsets one lane's ldmatrix row addresses take in a swizzled tile, for
// loops over row blocks and head-dim steps that are unrolled. A lane reads
// chunk 2 * step + half of row first_row + lane_row (first_row a multiple of
// 8; lane_row and half fixed per lane), which sits at
//   first_row * D + 64 * (step / 4) + low[step % 4],
//   low[i] = lane_row * D + ((16 i + 8 half) ^ (8 (lane_row % 8))),
// since a row is a multiple of 64 values and the swizzle flips bits 3..5 only.
// Two of the three terms are constants, so each ldmatrix address is one of
// four registers plus an immediate; SwizzledTile::offset in such loops left
// ptxas holding one register per (row, chunk) pair across the key loop (~64 at
// head dim 128). With copy_offset, in the prefill kernel (H200, one causal
// prompt of 4096 tokens, 32 / 8 heads, bf16; bit for bit the same outputs):
// D 128 204 -> 211 TFLOP/s, D 64 171 -> 180.
template <int kHeadDim>
struct LaneTileOffsets {
  static_assert(kHeadDim % 64 == 0, "rows of a multiple of 64 values (8 chunks)");
  int low[4];

  __device__ __forceinline__ LaneTileOffsets(int lane_row, int half) {
#pragma unroll
    for (int i = 0; i < 4; ++i) low[i] = lane_row * kHeadDim + ((16 * i + 8 * half) ^ (8 * (lane_row & 7)));
  }
  // Element offset of chunk 2 * step + half of row first_row + lane_row.
  __device__ __forceinline__ int operator()(int first_row, int step) const {
    return first_row * kHeadDim + 64 * (step / 4) + low[step % 4];
  }
};

// Rows [0, num_valid) of src (row r at src + r * row_stride) into a tile;
// later rows are zero-filled. src must point at a readable row. Tile: the layout.
template <typename T, int kHeadDim, int kRows, int kThreads, typename Tile = SwizzledTile<kHeadDim>>
__device__ __forceinline__ void load_rows_async(T* tile, const T* src, int64_t row_stride, int num_valid, int tid) {
  constexpr int kChunks = kRows * Tile::kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int k = 0; k < kChunks / kThreads; ++k) {
    const int i = tid + k * kThreads;
    const int row = i / Tile::kChunksPerRow;
    const int chunk = i % Tile::kChunksPerRow;
    const bool valid = row < num_valid;
    const T* from = valid ? src + row * row_stride + chunk * 8 : src;
    cp_async_16(tile + Tile::template copy_offset<kThreads>(tid, k), from, valid);
  }
}

// Keys and values of tokens [first, first + kRows) of one kv head, gathered
// through block_table into two tiles. Tokens at or past `end` are zero-filled
// and their block table entries never read, so masked scores meet zero values
// (0 * 0, never 0 * NaN from stale shared memory).
template <typename T, int kHeadDim, int kBlockSize, int kRows, int kThreads, typename Tile = SwizzledTile<kHeadDim>>
__device__ __forceinline__ void load_kv_tiles_async(T* key_tile, T* value_tile, const T* key_cache,
                                                    const T* value_cache, const int32_t* block_table, int first,
                                                    int end, int kv_head, int num_kv_heads, int tid) {
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
    const int dst = Tile::template copy_offset<kThreads>(tid, k);
    cp_async_16(key_tile + dst, key_cache + offset, valid);
    cp_async_16(value_tile + dst, value_cache + offset, valid);
  }
}

}  // namespace pagedserve::cuda
