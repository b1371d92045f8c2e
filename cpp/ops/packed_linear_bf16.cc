// y = bf16(x) W^T + b: packed_linear with bf16 activations, W in the packed
// bf16 layout of packed_weight_layout.h.
//
// x (float32, rounded to bf16 to nearest-even, or bf16 as given) is first
// laid out as pairs: one 32-bit word (x[2p], x[2p + 1]) per K pair, rows
// padded to a multiple of 16 and K to the weights' K_pad with zeros. Every
// product of two bf16 values is exact in float32; only the float32 sums
// round. Kernels, chosen by cpu_isa():
//  - amx: one bf16 tile product per 32-deep K chunk (the float32-exact
//    packed_linear needs three, one per bf16 term of x).
//  - avx512_bf16: `vdpbf16ps` multiplies a packed weight row (16 words) by
//    x's pair broadcast as one word: 32 multiply-adds per instruction, twice
//    the float32 FMA's, and no widening of the weights.
//  - avx512 / avx2 / baseline: the weights widened to float32 (shift or
//    mask), loops the compiler vectorizes for the level.
// Each output is summed in the same order whatever the batch and the thread
// count (column tiles split across threads, rows never split K), so a row's
// result does not depend on its neighbours or on the pool.
#include <algorithm>
#include <bit>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "ops/cpu_isa.h"
#include "ops/float_types.h"
#include "ops/op_contracts.h"
#include "ops/ops.h"
#include "ops/packed_weight_layout.h"
#include "ops/parallel.h"
#include "ops/tile_kernel_driver.h"

namespace pagedserve::ops {
namespace {

constexpr int64_t kRowChunk = 128;  // rows of x kept hot while every weight tile passes over them
constexpr int64_t kAmxRows = 16;    // one AMX tile's rows; x's rows are padded to a multiple
constexpr int kVecRows = 12;        // 2 x 12 accumulators + 2 weight rows + a broadcast < 32 zmm
constexpr int64_t kTileWords = kPackedCols;

struct Bf16Problem {
  const uint32_t* x;       // [round_up(M, 16), k_pairs] words, (x[2p], x[2p + 1]) as bf16, zero-padded
  const uint32_t* packed;  // [tiles, k_pairs, 16] words (packed_weight_layout.h)
  const float* bias;       // [N] or null
  void* out;               // [M, N] float32 or bf16
  bool out_bf16;
  int64_t rows;          // M
  int64_t out_features;  // N
  int64_t k_pairs;       // K_pad / 2

  const uint32_t* tile(int64_t t) const { return packed + t * k_pairs * kTileWords; }
  const uint32_t* x_row(int64_t row) const { return x + row * k_pairs; }
  int64_t valid_cols(int64_t t) const { return std::min(kPackedCols, out_features - t * kPackedCols); }
  float bias_at(int64_t n) const { return bias ? bias[n] : 0.0f; }
};

PS_ALWAYS_INLINE float low_bf16(uint32_t word) { return std::bit_cast<float>(word << 16); }
PS_ALWAYS_INLINE float high_bf16(uint32_t word) { return std::bit_cast<float>(word & 0xffff0000u); }

// ---------------------------------------------------------------------------
// x into bf16 pairs.

PS_ALWAYS_INLINE void round_row(const float* x, int64_t k_size, BFloat16* dst) {
  for (int64_t k = 0; k < k_size; ++k) dst[k] = float_to_bf16(x[k]);
}

// Writes x [M, K] as bf16 into scratch [round_up(M, 16), K_pad], zero-padded.
const uint32_t* x_as_pairs(const TensorView& x, int64_t k_pairs, std::vector<uint32_t>& scratch) {
  const int64_t rows = x.size(0), k_size = x.size(1), k_pad = 2 * k_pairs;
  const int64_t padded_rows = (rows + kAmxRows - 1) / kAmxRows * kAmxRows;
  scratch.assign(static_cast<size_t>(padded_rows * k_pairs), 0u);
  auto* dst = reinterpret_cast<BFloat16*>(scratch.data());
  for (int64_t row = 0; row < rows; ++row) {
    if (x.dtype == DType::kBFloat16) {
      std::memcpy(dst + row * k_pad, x.ptr<BFloat16>() + row * k_size, static_cast<size_t>(k_size) * 2);
    } else {
      const float* src = x.ptr<float>() + row * k_size;
      with_cpu_isa([&]() PS_INLINE_BODY { round_row(src, k_size, dst + row * k_pad); });
    }
  }
  return scratch.data();
}

// ---------------------------------------------------------------------------
// Widened kernels (avx512 without bf16, avx2, baseline): one row at a time.

PS_ALWAYS_INLINE void store_scalar(const Bf16Problem& p, int64_t t, int64_t row, const float* acc) {
  const int64_t col0 = t * kPackedCols;
  for (int64_t c = 0; c < p.valid_cols(t); ++c) {
    const float value = acc[c] + p.bias_at(col0 + c);
    const int64_t at = row * p.out_features + col0 + c;
    if (p.out_bf16) {
      static_cast<BFloat16*>(p.out)[at] = float_to_bf16(value);
    } else {
      static_cast<float*>(p.out)[at] = value;
    }
  }
}

// The odd element of a pair first, then the even one: vdpbf16ps's order.
PS_ALWAYS_INLINE void tile_widened(const Bf16Problem& p, int64_t t, int64_t row_begin, int64_t row_end) {
  const uint32_t* words = p.tile(t);
  for (int64_t row = row_begin; row < row_end; ++row) {
    float acc[kPackedCols] = {};
    const uint32_t* x = p.x_row(row);
    for (int64_t kp = 0; kp < p.k_pairs; ++kp) {
      const float x_even = low_bf16(x[kp]), x_odd = high_bf16(x[kp]);
      const uint32_t* w = words + kp * kTileWords;
      for (int64_t c = 0; c < kPackedCols; ++c) acc[c] = (acc[c] + high_bf16(w[c]) * x_odd) + low_bf16(w[c]) * x_even;
    }
    store_scalar(p, t, row, acc);
  }
}

#if PS_X86_MULTIVERSION
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's AVX-512 headers (see packed_linear_x86.inc)
#pragma GCC diagnostic ignored "-Wuninitialized"

// out[row, tile t's valid columns] = acc + bias, as float32 or bf16 (nearest-even, NaN kept NaN).
[[gnu::target("arch=x86-64-v4")]] PS_ALWAYS_INLINE void store_row(const Bf16Problem& p, int64_t t, int64_t row,
                                                                   __m512 acc) {
  const int64_t valid = p.valid_cols(t);
  const auto mask = static_cast<__mmask16>(valid >= kPackedCols ? 0xffffu : (1u << valid) - 1u);
  const int64_t col0 = t * kPackedCols;
  const int64_t at = row * p.out_features + col0;
  if (p.bias != nullptr) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, p.bias + col0));
  if (!p.out_bf16) {
    _mm512_mask_storeu_ps(static_cast<float*>(p.out) + at, mask, acc);
    return;
  }
  const __m512i bits = _mm512_castps_si512(acc);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(acc, acc, _CMP_UNORD_Q);
  rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  _mm256_mask_storeu_epi16(static_cast<BFloat16*>(p.out) + at, mask, _mm512_cvtepi32_epi16(rounded));
}

// Rows [row0, row0 + kRows) x column tiles t and t + 1 (t + 1 may be past
// the end: then it is computed from t's weights and not stored).
template <int kRows>
[[gnu::target("arch=x86-64-v4,avx512bf16")]] void block_dpbf16(const Bf16Problem& p, int64_t t, bool pair,
                                                               int64_t row0) {
  const uint32_t* w0 = p.tile(t);
  const uint32_t* w1 = pair ? p.tile(t + 1) : w0;
  const uint32_t* x = p.x_row(row0);
  const int64_t k_pairs = p.k_pairs;
  __m512 acc[2][kRows];
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < k_pairs; ++kp) {
    const auto a = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w0 + kp * kTileWords));
    const auto b = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w1 + kp * kTileWords));
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) {
      const auto xr = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[r * k_pairs + kp])));
      acc[0][r] = _mm512_dpbf16_ps(acc[0][r], a, xr);
      acc[1][r] = _mm512_dpbf16_ps(acc[1][r], b, xr);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
    store_row(p, t, row0 + r, acc[0][r]);
    if (pair) store_row(p, t + 1, row0 + r, acc[1][r]);
  }
}

// Rows [row_begin, row_end) x tiles t, t + 1 in balanced blocks of at most kVecRows.
void tile_pair_dpbf16(const Bf16Problem& p, int64_t t, int64_t row_begin, int64_t row_end) {
  const bool pair = t + 1 < packed_col_tiles(p.out_features);
  for_row_blocks<kVecRows>(row_begin, row_end, [&]<int kRows>(int64_t row0) { block_dpbf16<kRows>(p, t, pair, row0); });
}

// ---------------------------------------------------------------------------
// AMX: tiles of 16 rows x 16 columns, K chunks of 32 (16 pair words).

// Tiles t and t + 1 (if `pair`) for rows [row0, row0 + rows). Two
// accumulators per column tile, even and odd K chunks, so consecutive tile
// products do not wait on each other: registers 0-1 even sums, 2-3 odd
// sums, 4-5 x, 6-7 the weights.
[[gnu::target("arch=x86-64-v4,amx-tile,amx-bf16")]] void tile_pair_amx(const Bf16Problem& p, int64_t row0,
                                                                        int64_t rows, int64_t t, bool pair) {
  constexpr int64_t kChunkWords = (kPackedKChunk / 2) * kTileWords;  // one weight tile register
  const int64_t chunks = 2 * p.k_pairs / kPackedKChunk;
  const int64_t x_stride = p.k_pairs * static_cast<int64_t>(sizeof(uint32_t));
  const uint32_t* x = p.x_row(row0);
  const uint32_t* w0 = p.tile(t);
  const uint32_t* w1 = pair ? p.tile(t + 1) : w0;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t c = 0; c < chunks; c += 2) {
    for (int64_t ahead = c + kAmxPrefetchChunks; ahead < c + kAmxPrefetchChunks + 2; ++ahead) {
      prefetch_weight_chunk(w0 + ahead * kChunkWords);  // past the tile's end: the next tile's (harmless)
      if (pair) prefetch_weight_chunk(w1 + ahead * kChunkWords);
    }
    _tile_loadd(6, w0 + c * kChunkWords, 64);
    if (pair) _tile_loadd(7, w1 + c * kChunkWords, 64);
    _tile_loadd(4, x + c * (kPackedKChunk / 2), x_stride);
    _tile_dpbf16ps(0, 4, 6);
    if (pair) _tile_dpbf16ps(1, 4, 7);
    if (c + 1 == chunks) break;
    _tile_loadd(6, w0 + (c + 1) * kChunkWords, 64);
    if (pair) _tile_loadd(7, w1 + (c + 1) * kChunkWords, 64);
    _tile_loadd(5, x + (c + 1) * (kPackedKChunk / 2), x_stride);
    _tile_dpbf16ps(2, 5, 6);
    if (pair) _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float acc[4][kAmxRows][kPackedCols];
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

void run_pairs_amx(const Bf16Problem& p, int64_t pair_begin, int64_t pair_end, int64_t row_begin, int64_t row_end) {
  for_amx_tile_pairs(packed_col_tiles(p.out_features), pair_begin, pair_end, row_begin, row_end,
                     [&](int64_t row0, int64_t rows, int64_t t, bool pair) { tile_pair_amx(p, row0, rows, t, pair); });
}

#pragma GCC diagnostic pop
#endif

// Tile pairs [pair_begin, pair_end) x rows [row_begin, row_end) with the level's kernel.
void run_pairs(const Bf16Problem& p, int64_t pair_begin, int64_t pair_end, int64_t row_begin, int64_t row_end) {
#if PS_X86_MULTIVERSION
  if (cpu_isa() == CpuIsa::kAmx) return run_pairs_amx(p, pair_begin, pair_end, row_begin, row_end);
  if (cpu_isa() == CpuIsa::kAvx512Bf16) {
    for (int64_t pair = pair_begin; pair < pair_end; ++pair) tile_pair_dpbf16(p, 2 * pair, row_begin, row_end);
    return;
  }
#endif
  const int64_t tile_end = std::min(packed_col_tiles(p.out_features), 2 * pair_end);
  with_cpu_isa([&]() PS_INLINE_BODY {
    for (int64_t t = 2 * pair_begin; t < tile_end; ++t) tile_widened(p, t, row_begin, row_end);
  });
}

void check_bf16_linear(const TensorView& out, const TensorView& x, const TensorView& packed,
                       const std::optional<TensorView>& bias) {
  constexpr std::string_view op = "packed_linear_bf16";
  require_float_tensor(op, "x", x, Device::kCPU, 2);
  require_float_tensor(op, "out", out, Device::kCPU, 2);
  for (const auto& [name, t] : {std::pair<std::string_view, const TensorView&>{"x", x}, {"out", out}}) {
    PS_REQUIRE(t.dtype != DType::kFloat16, op, std::string(name) + " must be float32 or bfloat16, got float16");
  }
  check_packed_linear_operands(op, out, x, packed, bias);
}

}  // namespace

void packed_linear_bf16(const TensorView& out, const TensorView& x, const TensorView& packed_weight,
                        const std::optional<TensorView>& bias) {
  check_bf16_linear(out, x, packed_weight, bias);
  const int64_t rows = x.size(0), out_features = out.size(1), k_pairs = packed_k_pairs(x.size(1));
  thread_local std::vector<uint32_t> scratch;  // the caller's; workers only read it during the call
  const Bf16Problem p{x_as_pairs(x, k_pairs, scratch), packed_weight.ptr<uint32_t>(),
                      bias ? bias->ptr<float>() : nullptr, out.data, out.dtype == DType::kBFloat16,
                      rows, out_features, k_pairs};
  const int64_t pairs = (packed_col_tiles(out_features) + 1) / 2;
  for (int64_t row_begin = 0; row_begin < rows; row_begin += kRowChunk) {
    const int64_t row_end = std::min(rows, row_begin + kRowChunk);
    // Work units (parallel.h): a 32-lane bf16 dot product is about one, and so is streaming one weight (as
    // packed_linear counts it: a decode step's weights come from DRAM, slower than a cached stream).
    const int64_t work_per_pair = 2 * ((row_end - row_begin) + 2 * kPackedCols) * k_pairs;
    parallel_for_range(pairs, work_per_pair, [&](int64_t pair_begin, int64_t pair_end) {
      run_pairs(p, pair_begin, pair_end, row_begin, row_end);
    });
  }
}

std::string_view packed_linear_bf16_kernel() {
  switch (cpu_isa()) {
    case CpuIsa::kAmx: return "amx_bf16";
    case CpuIsa::kAvx512Bf16: return "avx512_bf16";
    case CpuIsa::kAvx512: return "avx512_widened";
    case CpuIsa::kAvx2: return "avx2_widened";
    case CpuIsa::kBaseline: break;
  }
  return "baseline_widened";
}

}  // namespace pagedserve::ops
