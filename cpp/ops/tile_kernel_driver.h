// How the tiled CPU matrix kernels walk a product, shared by the three that
// multiply 16-column weight tiles: packed_linear (bf16 tiles, float32 x),
// packed_linear_bf16 (bf16 tiles, bf16 x) and int8_linear (int8 tiles).
//
// Each kernel computes a block of rows of x against a pair of column tiles,
// its accumulators in registers: n rows x 2 tiles of 16 outputs, n a
// compile-time constant so the accumulators can be named registers. This
// header holds the walk around that block, which is the same for all three:
//  - for_row_blocks: rows cut into balanced blocks of at most kMaxRows
//    (13 rows as 7 + 6, not 12 + 1), each handed to the block kernel
//    instantiated for its row count;
//  - AMX: the tile configuration they use (64-byte rows; 16 rows, or x's
//    rows where it has fewer), the walk of tile pairs x 16-row blocks in
//    one thread, and the prefetch of the weights ahead of the tile loads.
// Column tiles are split across threads by the callers and no K sum is, so a
// row's result never depends on the batch or the thread count.
#pragma once

#include <algorithm>
#include <cstdint>

#include "ops/cpu_isa.h"

#if PS_X86_MULTIVERSION
#include <immintrin.h>
#endif

namespace pagedserve::ops {

namespace tile_driver_detail {

template <int kRows, typename Block>
PS_ALWAYS_INLINE void with_rows(int rows, int64_t row0, Block& block) {
  if constexpr (kRows >= 1) {
    if (rows == kRows) return block.template operator()<kRows>(row0);
    return with_rows<kRows - 1>(rows, row0, block);
  }
}

}  // namespace tile_driver_detail

// Rows [row_begin, row_end) in balanced blocks of at most kMaxRows rows:
// block.template operator()<n>(row0) for each, n its row count.
template <int kMaxRows, typename Block>
void for_row_blocks(int64_t row_begin, int64_t row_end, Block&& block) {
  const int64_t rows = row_end - row_begin;
  const int64_t blocks = (rows + kMaxRows - 1) / kMaxRows;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = row_begin + rows * b / blocks;
    const int64_t end = row_begin + rows * (b + 1) / blocks;
    tile_driver_detail::with_rows<kMaxRows>(static_cast<int>(end - begin), begin, block);
  }
}

#if PS_X86_MULTIVERSION

inline constexpr int64_t kAmxTileRows = 16;  // rows of x per tile product (one tile register's rows)

// The 64 bytes `ldtilecfg` reads (palette 1).
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(AmxTileConfig) == 64);

// The configuration every kernel uses: registers 0-7 of 64 bytes a row; the accumulators (0-3) and
// x (4-5) of `x_rows` rows, the weights (6-7) of 16 (a K chunk). Fewer than 16 rows where x has
// fewer: a decode step of one sequence then loads, multiplies and stores one row instead of 16
// (each row's products are the same either way).
inline AmxTileConfig amx_tile_config(int x_rows) {
  AmxTileConfig config;
  for (int i = 0; i < 8; ++i) {
    config.rows[i] = static_cast<uint8_t>(i < 6 ? x_rows : kAmxTileRows);
    config.bytes_per_row[i] = 64;
  }
  return config;
}

// Loads it. Not through GCC 12's _tile_loadconfig, whose asm names only the first 8 bytes of the
// configuration as its operand: GCC 12 -O3 then dropped the stores of the rows and row widths as dead,
// every tile was left unconfigured and the first tile instruction raised SIGILL (Debian 12's compiler,
// an Intel family 6 model 207 VM, session 40; GCC 13 names all 64 bytes). Here the operand is the whole
// struct, and the memory clobber keeps every store before it (x's scratch rows among them: the tile loads'
// asm names no memory) ahead of the tile code.
[[gnu::target("arch=x86-64-v4,amx-tile")]] inline void configure_amx_tiles(int x_rows) {
  const AmxTileConfig config = amx_tile_config(x_rows);
  __asm__ volatile("ldtilecfg %0" : : "m"(config) : "memory");
}

[[gnu::target("arch=x86-64-v4,amx-tile")]] inline void release_amx_tiles() { _tile_release(); }

// A tile load waits for its 16 lines, and the next load into the same register waits for the tile
// product reading it: with two weight registers a core keeps ~2 KiB in flight, too little to hide
// the memory's latency when a few rows of x leave the products idle. The kernels therefore ask for
// each weight stream's chunk kAmxPrefetchChunks ahead into L1 (16 lines, 1 KiB each). Intel host
// (family 6 model 207, 2 pinned cores, cold weights): batch-1 bf16 decode 46 -> 53 tok/s at a
// distance of 4 (2 and 8 within noise of it); 16 rows and more unchanged.
inline constexpr int64_t kAmxPrefetchChunks = 4;

PS_ALWAYS_INLINE void prefetch_weight_chunk(const void* chunk) {
  const char* bytes = static_cast<const char*>(chunk);
  for (int line = 0; line < 16; ++line) _mm_prefetch(bytes + 64 * line, _MM_HINT_T0);
}

// Tile pairs [pair_begin, pair_end) of a weight of `tiles` column tiles against rows [row_begin, row_end)
// in 16-row blocks, in this thread: tile_pair(row0, rows, t, pair) per block, t the pair's first tile and
// pair whether tile t + 1 exists. The tiles are configured first and released after (a thread holding no
// tile state keeps context switches cheap).
template <typename TilePair>
void for_amx_tile_pairs(int64_t tiles, int64_t pair_begin, int64_t pair_end, int64_t row_begin, int64_t row_end,
                        TilePair&& tile_pair) {
  configure_amx_tiles(static_cast<int>(std::clamp<int64_t>(row_end - row_begin, 1, kAmxTileRows)));
  for (int64_t pair = pair_begin; pair < pair_end; ++pair) {
    for (int64_t row0 = row_begin; row0 < row_end; row0 += kAmxTileRows) {
      tile_pair(row0, std::min(kAmxTileRows, row_end - row0), 2 * pair, 2 * pair + 1 < tiles);
    }
  }
  release_amx_tiles();
}

#endif

}  // namespace pagedserve::ops
