// y = x W^T + b with float32 activations and W stored bf16 in the packed
// layout of packed_weight_layout.h (see there for why).
//
// Three kernels, one result up to summation order:
//  - AMX: x is split exactly into three bf16 terms, x = hi + mid + lo (each
//    the bf16 rounding of what the previous ones left; 3 x 8 bits cover
//    float32's 24), and W x = W hi + W mid + W lo runs as bf16 tile products
//    accumulated in float32. Every product of two bf16 values is exact in
//    float32, so this is a float32 GEMM with a different summation order, at
//    a rate that leaves the step bound by streaming the weights.
//  - AVX-512: widens each weight to float32 (one shift or mask per 16) and
//    keeps a block of up to 12 rows of x in registers against two column tiles.
//  - AVX2 (Zen 3, Haswell and later without AVX-512): the same against one
//    column tile (two 8-lane halves), blocks of up to 6 rows: 12 accumulators,
//    two widened weight vectors and a broadcast fill the 16 ymm registers.
//  - portable: plain loops the compiler vectorizes (other ISAs; the oracle's
//    second opinion in tests).
// The AVX-512, AVX2 and portable kernels add each output's products in K
// order, one fused multiply-add at a time, so they give the same bits (where
// the compiler fuses the portable loop's; tests_py/test_cpu_weight_packing.py);
// AMX's three bf16 terms sum in another order.
// Column tiles are split across threads; each tile's weights stay in L1/L2
// while every row block of x passes over them.
#include <algorithm>
#include <bit>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "ops/cpu_isa.h"
#include "ops/dispatch.h"
#include "ops/float_types.h"
#include "ops/op_contracts.h"
#include "ops/ops.h"
#include "ops/packed_weight_layout.h"
#include "ops/parallel.h"
#include "ops/tile_kernel_driver.h"

namespace pagedserve::ops {
namespace {

// Rows of x kept hot in cache while every weight tile passes over them (prefill).
constexpr int64_t kRowChunk = 128;
// Rows per register block: one AMX tile's rows; for AVX-512, 2 x 12
// accumulators + 2 weight vectors + a broadcast fill the 32 zmm registers.
constexpr int kBlockRows = 16;  // kAmxTileRows (tile_kernel_driver.h)
constexpr int kAvx512BlockRows = 12;
constexpr int kAvx2BlockRows = 6;
constexpr int64_t kTileWords = kPackedCols;  // 32-bit words (bf16 pairs) per packed row

struct LinearProblem {
  const float* x;          // [M, K]
  const uint32_t* packed;  // [tiles, k_pairs, 16] words, each a pair of bf16 (packed_weight_layout.h)
  const float* bias;       // [N] or null
  float* out;              // [M, N]
  int64_t rows;            // M
  int64_t in_features;     // K
  int64_t out_features;    // N
  int64_t k_pairs;         // K_pad / 2

  const uint32_t* tile(int64_t t) const { return packed + t * k_pairs * kTileWords; }
  int64_t valid_cols(int64_t t) const { return std::min(kPackedCols, out_features - t * kPackedCols); }
  float bias_at(int64_t n) const { return bias ? bias[n] : 0.0f; }
};

PS_ALWAYS_INLINE float low_bf16(uint32_t word) { return std::bit_cast<float>(word << 16); }
PS_ALWAYS_INLINE float high_bf16(uint32_t word) { return std::bit_cast<float>(word & 0xffff0000u); }

// Rows [row_begin, row_end) x one column tile, any ISA.
PS_ALWAYS_INLINE void tile_portable(const LinearProblem& p, int64_t t, int64_t row_begin, int64_t row_end) {
  const uint32_t* words = p.tile(t);
  const int64_t k_size = p.in_features;
  for (int64_t row = row_begin; row < row_end; ++row) {
    float acc[kPackedCols] = {};
    const float* x = p.x + row * k_size;
    for (int64_t k = 0; k < k_size; ++k) {
      const float xv = x[k];
      const uint32_t* w = words + (k / 2) * kTileWords;
      if (k % 2 == 0) {
        for (int64_t c = 0; c < kPackedCols; ++c) acc[c] += low_bf16(w[c]) * xv;
      } else {
        for (int64_t c = 0; c < kPackedCols; ++c) acc[c] += high_bf16(w[c]) * xv;
      }
    }
    float* out = p.out + row * p.out_features + t * kPackedCols;
    for (int64_t c = 0; c < p.valid_cols(t); ++c) out[c] = acc[c] + p.bias_at(t * kPackedCols + c);
  }
}

#if PS_X86_MULTIVERSION
// GCC 12's AVX-512 headers build some vectors from a deliberately undefined
// one (`__m512i __Y = __Y;`), which -Wmaybe-uninitialized flags at every use.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

[[gnu::target("arch=x86-64-v4")]] PS_ALWAYS_INLINE __mmask16 column_mask(int64_t valid) {
  return static_cast<__mmask16>(valid >= kPackedCols ? 0xffffu : (1u << valid) - 1u);
}

// out[row0 + r, tile cols] = acc[r] + bias, for the tile's valid columns.
[[gnu::target("arch=x86-64-v4")]] PS_ALWAYS_INLINE void store_row(const LinearProblem& p, int64_t t, int64_t row,
                                                                   __m512 acc) {
  const __mmask16 mask = column_mask(p.valid_cols(t));
  const int64_t col0 = t * kPackedCols;
  if (p.bias != nullptr) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, p.bias + col0));
  _mm512_mask_storeu_ps(p.out + row * p.out_features + col0, mask, acc);
}

// Rows [row0, row0 + kRows) x column tiles t and t + 1 (t + 1 may be past
// the end: then it is computed from t's weights and not stored). Two tiles
// per block halve the broadcasts of x per multiply-add.
template <int kRows>
[[gnu::target("arch=x86-64-v4")]] void block_avx512(const LinearProblem& p, int64_t t, bool pair, int64_t row0) {
  const int64_t k_size = p.in_features;
  const uint32_t* words[2] = {p.tile(t), pair ? p.tile(t + 1) : p.tile(t)};
  const float* x = p.x + row0 * k_size;
  __m512 acc[2][kRows];
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
  const __m512i high_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const int64_t full_pairs = k_size / 2;
  for (int64_t kp = 0; kp < full_pairs; ++kp) {
    for (int i = 0; i < 2; ++i) {
      const __m512i w = _mm512_loadu_si512(words[i] + kp * kTileWords);
      const __m512 w_even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
      const __m512 w_odd = _mm512_castsi512_ps(_mm512_and_si512(w, high_mask));
#pragma GCC unroll 16
      for (int r = 0; r < kRows; ++r) {
        acc[i][r] = _mm512_fmadd_ps(w_even, _mm512_set1_ps(x[r * k_size + 2 * kp]), acc[i][r]);
        acc[i][r] = _mm512_fmadd_ps(w_odd, _mm512_set1_ps(x[r * k_size + 2 * kp + 1]), acc[i][r]);
      }
    }
  }
  if (k_size % 2 != 0) {  // the last k of an odd K has no partner in x
    for (int i = 0; i < 2; ++i) {
      const __m512 w_even =
          _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(words[i] + full_pairs * kTileWords), 16));
#pragma GCC unroll 16
      for (int r = 0; r < kRows; ++r) {
        acc[i][r] = _mm512_fmadd_ps(w_even, _mm512_set1_ps(x[r * k_size + k_size - 1]), acc[i][r]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
    store_row(p, t, row0 + r, acc[0][r]);
    if (pair) store_row(p, t + 1, row0 + r, acc[1][r]);
  }
}

// out[row, tile t's cols] = (lo | hi) + bias, 8 + 8 lanes; a partial tile goes through a buffer.
[[gnu::target("arch=x86-64-v3")]] PS_ALWAYS_INLINE void store_row_avx2(const LinearProblem& p, int64_t t, int64_t row,
                                                                        __m256 lo, __m256 hi) {
  const int64_t col0 = t * kPackedCols;
  const int64_t valid = p.valid_cols(t);
  alignas(32) float buf[kPackedCols];
  float* dst = valid == kPackedCols ? p.out + row * p.out_features + col0 : buf;
  if (p.bias != nullptr && valid == kPackedCols) {
    lo = _mm256_add_ps(lo, _mm256_loadu_ps(p.bias + col0));
    hi = _mm256_add_ps(hi, _mm256_loadu_ps(p.bias + col0 + 8));
  }
  _mm256_storeu_ps(dst, lo);
  _mm256_storeu_ps(dst + 8, hi);
  if (valid < kPackedCols) {
    for (int64_t c = 0; c < valid; ++c) p.out[row * p.out_features + col0 + c] = buf[c] + p.bias_at(col0 + c);
  }
}

// Eight packed words widened to float32: their low bf16 (even k) or high (odd k).
[[gnu::target("arch=x86-64-v3")]] PS_ALWAYS_INLINE __m256 widened_bf16(const uint32_t* words, bool odd) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words));
  return _mm256_castsi256_ps(odd ? _mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u)))
                                 : _mm256_slli_epi32(w, 16));
}

// Column tiles an AVX2 block of kRows rows takes side by side: each
// accumulator is a chain of dependent FMAs (4 cycles each on Zen 3), so a
// block needs about 8 of them to keep both FMA units busy; one or two rows
// (a decode step) get them from more tiles. M = 1, Zen 3, the LM head
// streamed from DRAM: 7.5 GB/s with one tile at a time.
constexpr int avx2_tiles_per_block(int rows) { return rows == 1 ? 3 : rows == 2 ? 2 : 1; }

// acc[r][i] += tile i's weights at `word` (their even or odd k) times x[r, k]: each output's products in K
// order, one FMA at a time (as block_avx512 and tile_portable).
template <int kRows, int kTiles>
[[gnu::target("arch=x86-64-v3")]] PS_ALWAYS_INLINE void multiply_add_avx2(__m256 (&acc)[kRows][kTiles][2],
                                                                           const uint32_t* const (&words)[kTiles],
                                                                           int64_t word, const float* x,
                                                                           int64_t k_size, int64_t k, bool odd) {
  __m256 w[kTiles][2];
#pragma GCC unroll 4
  for (int i = 0; i < kTiles; ++i) {
    w[i][0] = widened_bf16(words[i] + word, odd);
    w[i][1] = widened_bf16(words[i] + word + 8, odd);
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    const __m256 xv = _mm256_broadcast_ss(x + r * k_size + k);
#pragma GCC unroll 4
    for (int i = 0; i < kTiles; ++i) {
      acc[r][i][0] = _mm256_fmadd_ps(w[i][0], xv, acc[r][i][0]);
      acc[r][i][1] = _mm256_fmadd_ps(w[i][1], xv, acc[r][i][1]);
    }
  }
}

// Rows [row0, row0 + kRows) x column tiles [t, t + kTiles) on AVX2 + FMA;
// tiles past `tiles` (the end of this thread's range) repeat the last one and
// are not stored. The weights' even (low half) and odd (high half) K are widened in
// turn, so 2 kTiles weight vectors are live at a time.
template <int kRows, int kTiles>
[[gnu::target("arch=x86-64-v3")]] void block_avx2(const LinearProblem& p, int64_t t, int64_t tiles, int64_t row0) {
  const int64_t k_size = p.in_features;
  const uint32_t* words[kTiles];
  for (int i = 0; i < kTiles; ++i) words[i] = p.tile(std::min(t + i, tiles - 1));
  const float* x = p.x + row0 * k_size;
  __m256 acc[kRows][kTiles][2];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    for (int i = 0; i < kTiles; ++i) acc[r][i][0] = acc[r][i][1] = _mm256_setzero_ps();
  }
  const int64_t full_pairs = k_size / 2;
  for (int64_t kp = 0; kp < full_pairs; ++kp) {
    multiply_add_avx2<kRows, kTiles>(acc, words, kp * kTileWords, x, k_size, 2 * kp, false);
    multiply_add_avx2<kRows, kTiles>(acc, words, kp * kTileWords, x, k_size, 2 * kp + 1, true);
  }
  if (k_size % 2 != 0) {  // the last k of an odd K has no partner in x
    multiply_add_avx2<kRows, kTiles>(acc, words, full_pairs * kTileWords, x, k_size, k_size - 1, false);
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    for (int i = 0; i < kTiles && t + i < tiles; ++i) store_row_avx2(p, t + i, row0 + r, acc[r][i][0], acc[r][i][1]);
  }
}

// Rows [row_begin, row_end) x tiles [tile_begin, tile_end): groups of tiles
// (avx2_tiles_per_block of the rows), each against the rows in balanced
// blocks of at most kAvx2BlockRows (every block then has the group's size).
void tiles_avx2(const LinearProblem& p, int64_t tile_begin, int64_t tile_end, int64_t row_begin, int64_t row_end) {
  const int64_t group = avx2_tiles_per_block(static_cast<int>(std::min<int64_t>(row_end - row_begin, 3)));
  for (int64_t t = tile_begin; t < tile_end; t += group) {
    for_row_blocks<kAvx2BlockRows>(row_begin, row_end, [&]<int kRows>(int64_t row0) {
      block_avx2<kRows, avx2_tiles_per_block(kRows)>(p, t, tile_end, row0);
    });
  }
}

// Rows [row_begin, row_end) x tiles t, t + 1, in balanced blocks of at most kAvx512BlockRows.
void tile_pair_avx512(const LinearProblem& p, int64_t t, int64_t row_begin, int64_t row_end) {
  const bool pair = t + 1 < packed_col_tiles(p.out_features);
  for_row_blocks<kAvx512BlockRows>(row_begin, row_end,
                                   [&]<int kRows>(int64_t row0) { block_avx512<kRows>(p, t, pair, row0); });
}

// ---------------------------------------------------------------------------
// AMX, in tiles of 16 rows x 16 columns with K chunks of 32.

// x as bf16 terms: [row blocks][3 terms][16 rows][K_pad], zero-padded; term
// i of a value is bf16(value - terms 0..i-1), exact since each subtraction is.
struct SplitRows {
  std::vector<BFloat16> data;
  int64_t k_pad = 0;

  const BFloat16* term(int64_t block, int index) const {
    return data.data() + ((block * 3 + index) * kBlockRows) * k_pad;
  }
};

// One row of x into its three terms (k < K; the K padding is left alone).
PS_ALWAYS_INLINE void split_row(const float* x, int64_t k_size, float* rest, BFloat16* hi, BFloat16* mid, BFloat16* lo) {
  for (int64_t k = 0; k < k_size; ++k) rest[k] = x[k];
  for (BFloat16* term : {hi, mid, lo}) {
    for (int64_t k = 0; k < k_size; ++k) {
      term[k] = float_to_bf16(rest[k]);
      rest[k] -= bf16_to_float(term[k]);
    }
  }
}

SplitRows split_rows(const LinearProblem& p, int64_t row_begin, int64_t row_end) {
  SplitRows split;
  split.k_pad = 2 * p.k_pairs;
  const int64_t rows = row_end - row_begin;
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  // Zero only what no row writes: the K padding and the last block's missing rows.
  split.data.resize(static_cast<size_t>(blocks * 3 * kBlockRows * split.k_pad));
  std::vector<float> rest(static_cast<size_t>(p.in_features));
  for (int64_t block = 0; block < blocks; ++block) {
    for (int64_t r = 0; r < kBlockRows; ++r) {
      const int64_t row = row_begin + block * kBlockRows + r;
      BFloat16* terms[3];
      for (int i = 0; i < 3; ++i) terms[i] = split.data.data() + ((block * 3 + i) * kBlockRows + r) * split.k_pad;
      const int64_t written = row < row_end ? p.in_features : 0;
      if (written > 0) {
        with_cpu_isa([&]() PS_INLINE_BODY {
          split_row(p.x + row * p.in_features, p.in_features, rest.data(), terms[0], terms[1], terms[2]);
        });
      }
      for (BFloat16* term : terms) std::fill(term + written, term + split.k_pad, BFloat16{0});
    }
  }
  return split;
}

// Column tiles t and t + 1 (t + 1 may be past the end: then it is neither
// loaded, computed nor stored) for rows [row0, row0 + rows). Each tile has
// two accumulators, one for the hi products and one for mid + lo: a tile
// product has a long latency, and one accumulator per tile would chain three
// of them per K chunk. Tile registers: 0-1 hi sums, 2-3 mid + lo sums, 4-5
// the terms of x (alternating), 6-7 the weights.
[[gnu::target("arch=x86-64-v4,amx-tile,amx-bf16")]] void tile_pair_amx(const LinearProblem& p, const SplitRows& split,
                                                                        int64_t block, int64_t row0, int64_t rows,
                                                                        int64_t t, bool pair) {
  constexpr int64_t kChunkWords = (kPackedKChunk / 2) * kTileWords;  // one weight tile register
  const int64_t chunks = split.k_pad / kPackedKChunk;
  const int64_t x_stride = split.k_pad * static_cast<int64_t>(sizeof(BFloat16));
  const BFloat16* hi = split.term(block, 0);
  const BFloat16* mid = split.term(block, 1);
  const BFloat16* lo = split.term(block, 2);
  const uint32_t* w0 = p.tile(t);
  const uint32_t* w1 = pair ? p.tile(t + 1) : w0;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t k0 = c * kPackedKChunk;
    prefetch_weight_chunk(w0 + (c + kAmxPrefetchChunks) * kChunkWords);  // past the end: the next tile's
    if (pair) prefetch_weight_chunk(w1 + (c + kAmxPrefetchChunks) * kChunkWords);
    _tile_loadd(6, w0 + c * kChunkWords, 64);
    if (pair) _tile_loadd(7, w1 + c * kChunkWords, 64);
    _tile_loadd(4, hi + k0, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    if (pair) _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, mid + k0, x_stride);
    _tile_dpbf16ps(2, 5, 6);
    if (pair) _tile_dpbf16ps(3, 5, 7);
    _tile_loadd(4, lo + k0, x_stride);
    _tile_dpbf16ps(2, 4, 6);
    if (pair) _tile_dpbf16ps(3, 4, 7);
  }
  alignas(64) float acc[4][kBlockRows][kPackedCols];
  _tile_stored(0, acc[0], 64);
  _tile_stored(2, acc[2], 64);
  if (pair) {
    _tile_stored(1, acc[1], 64);
    _tile_stored(3, acc[3], 64);
  }
  for (int64_t r = 0; r < rows; ++r) {
    store_row(p, t, row0 + r, _mm512_add_ps(_mm512_load_ps(acc[0][r]), _mm512_load_ps(acc[2][r])));
    if (pair) store_row(p, t + 1, row0 + r, _mm512_add_ps(_mm512_load_ps(acc[1][r]), _mm512_load_ps(acc[3][r])));
  }
}

void run_pairs_amx(const LinearProblem& p, const SplitRows& split, int64_t pair_begin, int64_t pair_end,
                   int64_t row_begin, int64_t row_end) {
  for_amx_tile_pairs(packed_col_tiles(p.out_features), pair_begin, pair_end, row_begin, row_end,
                     [&](int64_t row0, int64_t rows, int64_t t, bool pair) {
                       tile_pair_amx(p, split, (row0 - row_begin) / kBlockRows, row0, rows, t, pair);
                     });
}

#pragma GCC diagnostic pop
#endif

void run_tiles(const LinearProblem& p, int64_t tile_begin, int64_t tile_end, int64_t row_begin, int64_t row_end) {
#if PS_X86_MULTIVERSION
  if (cpu_isa() >= CpuIsa::kAvx512) {  // ranges start at even tiles (see run_row_chunk)
    for (int64_t t = tile_begin; t < tile_end; t += 2) tile_pair_avx512(p, t, row_begin, row_end);
    return;
  }
  if (cpu_isa() == CpuIsa::kAvx2) {
    tiles_avx2(p, tile_begin, tile_end, row_begin, row_end);
    return;
  }
#endif
  with_cpu_isa([&]() PS_INLINE_BODY {
    for (int64_t t = tile_begin; t < tile_end; ++t) tile_portable(p, t, row_begin, row_end);
  });
}

// Rows [row_begin, row_end) against every column tile, the tiles split across threads.
void run_row_chunk(const LinearProblem& p, int64_t row_begin, int64_t row_end) {
  const int64_t tiles = packed_col_tiles(p.out_features);
  // Work units (parallel.h): a 16-lane multiply-add is about one, so is streaming one weight.
  const int64_t work_per_tile = ((row_end - row_begin) * 2 + kPackedCols) * p.in_features;
  const int64_t pairs = (tiles + 1) / 2;
#if PS_X86_MULTIVERSION
  if (cpu_isa() == CpuIsa::kAmx) {
    const SplitRows split = split_rows(p, row_begin, row_end);
    parallel_for_range(pairs, 2 * work_per_tile, [&](int64_t pair_begin, int64_t pair_end) {
      run_pairs_amx(p, split, pair_begin, pair_end, row_begin, row_end);
    });
    return;
  }
#endif
  parallel_for_range(pairs, 2 * work_per_tile, [&](int64_t pair_begin, int64_t pair_end) {
    run_tiles(p, 2 * pair_begin, std::min(tiles, 2 * pair_end), row_begin, row_end);
  });
}

}  // namespace

void pack_linear_weight(const TensorView& packed, const TensorView& weight) {
  constexpr std::string_view op = "pack_linear_weight";
  require_float_tensor(op, "weight", weight, Device::kCPU, 2);
  const int64_t out_features = weight.size(0);
  const int64_t in_features = weight.size(1);
  require_tensor_of(op, "packed_weight", packed, Device::kCPU, 3, DType::kBFloat16);
  require_size(op, "packed_weight", packed, 0, packed_col_tiles(out_features));
  require_size(op, "packed_weight", packed, 1, packed_k_pairs(in_features));
  require_size(op, "packed_weight", packed, 2, 2 * kPackedCols);
  auto* dst = packed.ptr<BFloat16>();
  std::memset(dst, 0, static_cast<size_t>(packed.numel()) * sizeof(BFloat16));  // padding is zero
  dispatch_float(weight.dtype, op, [&]<typename T>() {
    const T* src = weight.ptr<T>();
    for (int64_t n = 0; n < out_features; ++n) {
      for (int64_t k = 0; k < in_features; ++k) {
        dst[packed_weight_offset(n, k, in_features)] = float_to_bf16(to_float(src[n * in_features + k]));
      }
    }
  });
}

void packed_linear(const TensorView& out, const TensorView& x, const TensorView& packed_weight,
                   const std::optional<TensorView>& bias) {
  constexpr std::string_view op = "packed_linear";
  require_tensor_of(op, "x", x, Device::kCPU, 2, DType::kFloat32);
  require_tensor_of(op, "out", out, Device::kCPU, 2, DType::kFloat32);
  check_packed_linear_operands(op, out, x, packed_weight, bias);
  const int64_t rows = x.size(0);
  const int64_t in_features = x.size(1);
  const int64_t out_features = out.size(1);
  const LinearProblem p{x.ptr<float>(),  packed_weight.ptr<uint32_t>(), bias ? bias->ptr<float>() : nullptr,
                        out.ptr<float>(), rows, in_features, out_features, packed_k_pairs(in_features)};
  for (int64_t row_begin = 0; row_begin < rows; row_begin += kRowChunk) {
    run_row_chunk(p, row_begin, std::min(rows, row_begin + kRowChunk));
  }
}

}  // namespace pagedserve::ops
