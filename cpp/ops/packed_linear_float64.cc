// y = x W^T with W in packed_linear's bf16 tiles and every sum formed in
// float64: the products that tensor parallelism splits over their input
// (attention output, down projection) when a model runs in float32, so that
// TP = N adds up to the same float32 numbers as TP = 1
// (python/pagedserve/models/layers.py: Linear.float64_sums).
//
// Why float64 sums make the rank count irrelevant: a bf16 weight has 8
// significant bits and a float32 activation 24, so every product is exact in
// float64 (53 bits), and a float64 sum of K of them lies within about
// K * 2^-53 of the exact sum (relative to the sum of magnitudes), far inside
// half a float32 ulp (2^-25 relative). Rounded to float32 once - after
// TP = 1's single sum, or after the ranks' partial sums are added - both give
// the float32 nearest the exact sum, unless that sum lies within the margin
// of a rounding tie (rare: the margin is some K * 2^-29 of a float32 ulp,
// widened by cancellation). With float32 sums most outputs differ by an ulp or
// more between the two orders, and SmolLM2-135M's 30 layers carry that to
// 2e-5 in its logprobs (tests_py/test_tensor_parallel.py).
//
// out float32: float32(sum) + bias, the bias added in float32 as it is after
// an all-reduce. out float64: the sums alone (a rank's partial products, to be
// all-reduced in float64), no bias.
//
// The order of the sums, the same in both kernels so that every ISA gives the
// same bits: the even k and the odd k in two sums, each ascending from 0.0,
// then even + odd (two independent chains halve the multiply-add latency a
// decode step's single row waits on; exact products make a fused multiply-add
// and a multiply then add round alike). Kernels: AVX-512 (a column tile as two
// vectors of 8 doubles, up to 6 rows of x in registers), AVX2 (a tile as two
// halves of 8 columns, each two vectors of 4 doubles: up to 3 rows against one
// half, or one row against both) and portable loops.
#include <algorithm>
#include <bit>
#include <optional>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "ops/cpu_isa.h"
#include "ops/op_contracts.h"
#include "ops/ops.h"
#include "ops/packed_weight_layout.h"
#include "ops/parallel.h"
#include "ops/tile_kernel_driver.h"

namespace pagedserve::ops {
namespace {

constexpr int64_t kRowChunk = 128;  // rows of x that every weight tile passes over while it is in cache
// 6 rows x 4 vectors of accumulators + 4 weight vectors + 2 broadcasts = 30 of the 32 zmm registers.
constexpr int kAvx512BlockRows = 6;
// 3 rows x 2 halves (even, odd) x 2 vectors of 4 doubles + 2 weight vectors + a broadcast = 15 of 16 ymm.
constexpr int kAvx2BlockRows = 3;
constexpr int64_t kTileWords = kPackedCols;  // 32-bit words (bf16 pairs) per packed row

struct Float64Problem {
  const float* x;          // [M, K]
  const uint32_t* packed;  // [tiles, k_pairs, 16] words, each a pair of bf16
  const float* bias;       // [N] or null (float32 out only)
  float* out32;            // [M, N], or null
  double* out64;           // [M, N], or null
  int64_t in_features;     // K
  int64_t out_features;    // N
  int64_t k_pairs;

  const uint32_t* tile(int64_t t) const { return packed + t * k_pairs * kTileWords; }
  int64_t valid_cols(int64_t t) const { return std::min(kPackedCols, out_features - t * kPackedCols); }

  // Writes row `row`'s sums of tile t's columns.
  void store(int64_t t, int64_t row, const double* sums) const {
    const int64_t col0 = t * kPackedCols;
    for (int64_t c = 0; c < valid_cols(t); ++c) {
      if (out64 != nullptr) {
        out64[row * out_features + col0 + c] = sums[c];
      } else {
        out32[row * out_features + col0 + c] =
            static_cast<float>(sums[c]) + (bias != nullptr ? bias[col0 + c] : 0.0f);
      }
    }
  }
};

PS_ALWAYS_INLINE double low_bf16(uint32_t word) { return std::bit_cast<float>(word << 16); }
PS_ALWAYS_INLINE double high_bf16(uint32_t word) { return std::bit_cast<float>(word & 0xffff0000u); }

PS_ALWAYS_INLINE void tile_portable(const Float64Problem& p, int64_t t, int64_t row_begin, int64_t row_end) {
  const uint32_t* words = p.tile(t);
  for (int64_t row = row_begin; row < row_end; ++row) {
    double even[kPackedCols] = {}, odd[kPackedCols] = {};
    const float* x = p.x + row * p.in_features;
    for (int64_t k = 0; k < p.in_features; ++k) {
      const double xv = x[k];
      const uint32_t* w = words + (k / 2) * kTileWords;
      if (k % 2 == 0) {
        for (int64_t c = 0; c < kPackedCols; ++c) even[c] += low_bf16(w[c]) * xv;
      } else {
        for (int64_t c = 0; c < kPackedCols; ++c) odd[c] += high_bf16(w[c]) * xv;
      }
    }
    for (int64_t c = 0; c < kPackedCols; ++c) even[c] += odd[c];
    p.store(t, row, even);
  }
}

#if PS_X86_MULTIVERSION
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's AVX-512 headers (see packed_linear_x86.inc)

// The 16 float32 lanes of v as two vectors of 8 doubles (exact).
[[gnu::target("arch=x86-64-v4")]] PS_ALWAYS_INLINE void widen(__m512 v, __m512d& low, __m512d& high) {
  low = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
  high = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// Rows [row0, row0 + kRows) x column tile t.
template <int kRows>
[[gnu::target("arch=x86-64-v4")]] void block_avx512(const Float64Problem& p, int64_t t, int64_t row0) {
  const int64_t k_size = p.in_features;
  const uint32_t* words = p.tile(t);
  const float* x = p.x + row0 * k_size;
  // [even low, even high, odd low, odd high][row]: columns 0-7 and 8-15 of the even and odd sums.
  __m512d acc[4][kRows];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) acc[0][r] = acc[1][r] = acc[2][r] = acc[3][r] = _mm512_setzero_pd();
  const __m512i high_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const int64_t full_pairs = k_size / 2;
  for (int64_t kp = 0; kp < full_pairs; ++kp) {
    const __m512i w = _mm512_loadu_si512(words + kp * kTileWords);
    __m512d even_low, even_high, odd_low, odd_high;
    widen(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), even_low, even_high);
    widen(_mm512_castsi512_ps(_mm512_and_si512(w, high_mask)), odd_low, odd_high);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m512d xe = _mm512_set1_pd(x[r * k_size + 2 * kp]);
      const __m512d xo = _mm512_set1_pd(x[r * k_size + 2 * kp + 1]);
      acc[0][r] = _mm512_fmadd_pd(even_low, xe, acc[0][r]);
      acc[1][r] = _mm512_fmadd_pd(even_high, xe, acc[1][r]);
      acc[2][r] = _mm512_fmadd_pd(odd_low, xo, acc[2][r]);
      acc[3][r] = _mm512_fmadd_pd(odd_high, xo, acc[3][r]);
    }
  }
  if (k_size % 2 != 0) {  // the last k of an odd K has no partner in x
    __m512d even_low, even_high;
    widen(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(words + full_pairs * kTileWords), 16)), even_low,
          even_high);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m512d xe = _mm512_set1_pd(x[r * k_size + k_size - 1]);
      acc[0][r] = _mm512_fmadd_pd(even_low, xe, acc[0][r]);
      acc[1][r] = _mm512_fmadd_pd(even_high, xe, acc[1][r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    alignas(64) double sums[kPackedCols];
    _mm512_store_pd(sums, _mm512_add_pd(acc[0][r], acc[2][r]));
    _mm512_store_pd(sums + 8, _mm512_add_pd(acc[1][r], acc[3][r]));
    p.store(t, row0 + r, sums);
  }
}

// Eight packed words (8 columns) widened to doubles: their even (low) or odd (high) bf16, columns 0-3 and 4-7.
[[gnu::target("arch=x86-64-v3")]] PS_ALWAYS_INLINE void widen_avx2(const uint32_t* words, bool odd, __m256d& low,
                                                                    __m256d& high) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words));
  const __m256 f = _mm256_castsi256_ps(odd ? _mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u)))
                                           : _mm256_slli_epi32(w, 16));
  low = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
  high = _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1));
}

// Where a block kernel gets the weights of column tile t as doubles, 8 columns (a half) at a time.
// In registers: widened from the packed words at each use (one row block per tile: a decode step).
struct WeightsFromWords {
  const uint32_t* words;  // the tile's packed words
  [[gnu::target("arch=x86-64-v3")]] PS_ALWAYS_INLINE void load(int64_t k, int half, __m256d& low,
                                                              __m256d& high) const {
    widen_avx2(words + (k / 2) * kTileWords + 8 * half, k % 2 != 0, low, high);
  }
};

// Widened once per tile into a [K, 16] buffer, for tiles that several row blocks pass over: the widening is
// then done once per tile instead of once per block (bench/results/zen3_avx2_session20.md).
struct WeightsWidened {
  const double* wide;  // [K, kPackedCols]
  [[gnu::target("arch=x86-64-v3")]] PS_ALWAYS_INLINE void load(int64_t k, int half, __m256d& low,
                                                              __m256d& high) const {
    low = _mm256_loadu_pd(wide + k * kPackedCols + 8 * half);
    high = _mm256_loadu_pd(wide + k * kPackedCols + 8 * half + 4);
  }

  [[gnu::target("arch=x86-64-v3")]] static void widen_tile(const uint32_t* words, int64_t k_size, double* wide) {
    const WeightsFromWords from{words};
    for (int64_t k = 0; k < k_size; ++k) {
      for (int half = 0; half < 2; ++half) {
        __m256d low, high;
        from.load(k, half, low, high);
        _mm256_storeu_pd(wide + k * kPackedCols + 8 * half, low);
        _mm256_storeu_pd(wide + k * kPackedCols + 8 * half + 4, high);
      }
    }
  }
};

// One k of a block: acc[r][h][kParity] += w(k, half0 + h) * x[r][k].
template <int kParity, int kRows, int kHalves, typename Weights>
[[gnu::target("arch=x86-64-v3")]] PS_ALWAYS_INLINE void step_avx2(__m256d (&acc)[kRows][kHalves][2][2],
                                                                   const Weights& weights, const double* x,
                                                                   int64_t k_size, int half0, int64_t k) {
  __m256d w[kHalves][2];
#pragma GCC unroll 2
  for (int h = 0; h < kHalves; ++h) weights.load(k, half0 + h, w[h][0], w[h][1]);
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    const __m256d xv = _mm256_broadcast_sd(x + r * k_size + k);
#pragma GCC unroll 2
    for (int h = 0; h < kHalves; ++h) {
      acc[r][h][kParity][0] = _mm256_fmadd_pd(w[h][0], xv, acc[r][h][kParity][0]);
      acc[r][h][kParity][1] = _mm256_fmadd_pd(w[h][1], xv, acc[r][h][kParity][1]);
    }
  }
}

// The sums of rows [0, kRows) of x (doubles, [kRows, K]) x the columns of the halves [half0, half0 + kHalves)
// of a tile (8 columns each) into sums[r][8 half ..]: the even and odd chains of every column, then even + odd.
template <int kRows, int kHalves, typename Weights>
[[gnu::target("arch=x86-64-v3")]] void block_avx2(const Weights& weights, const double* x, int64_t k_size,
                                                  int half0, double (&sums)[kRows][kPackedCols]) {
  __m256d acc[kRows][kHalves][2][2];  // [row][half][even, odd][columns 0-3, 4-7 of the half]
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    for (int h = 0; h < kHalves; ++h) acc[r][h][0][0] = acc[r][h][0][1] = acc[r][h][1][0] = acc[r][h][1][1] =
        _mm256_setzero_pd();
  }
  const int64_t full_pairs = k_size / 2;
  for (int64_t kp = 0; kp < full_pairs; ++kp) {
    step_avx2<0>(acc, weights, x, k_size, half0, 2 * kp);
    step_avx2<1>(acc, weights, x, k_size, half0, 2 * kp + 1);
  }
  if (k_size % 2 != 0) step_avx2<0>(acc, weights, x, k_size, half0, k_size - 1);  // the last k has no partner
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    for (int h = 0; h < kHalves; ++h) {
      double* out = sums[r] + 8 * (half0 + h);
      _mm256_storeu_pd(out, _mm256_add_pd(acc[r][h][0][0], acc[r][h][1][0]));
      _mm256_storeu_pd(out + 4, _mm256_add_pd(acc[r][h][0][1], acc[r][h][1][1]));
    }
  }
}

// Rows [row0, row0 + kRows) (x: theirs, as doubles) x tile t: one row takes both halves at once (8
// independent chains for the multiply-add latency a decode step waits on); more rows take the halves in turn.
template <int kRows, typename Weights>
[[gnu::target("arch=x86-64-v3")]] void rows_avx2(const Float64Problem& p, int64_t t, int64_t row0, const double* x,
                                                 const Weights& weights) {
  double sums[kRows][kPackedCols];
  if constexpr (kRows == 1) {
    block_avx2<kRows, 2>(weights, x, p.in_features, 0, sums);
  } else {
    block_avx2<kRows, 1>(weights, x, p.in_features, 0, sums);
    block_avx2<kRows, 1>(weights, x, p.in_features, 1, sums);
  }
  for (int r = 0; r < kRows; ++r) p.store(t, row0 + r, sums[r]);
}

// Tiles [tile_begin, tile_end) x rows [row_begin, row_end), whose x the caller widened to doubles once
// (x_wide: [rows, K] from row_begin; a float broadcast per use cost a conversion each and ran the default
// model's o and down products at ~11 GFLOP/s on Zen 3).
[[gnu::target("arch=x86-64-v3")]] void tiles_avx2(const Float64Problem& p, const double* x_wide, int64_t tile_begin,
                                                  int64_t tile_end, int64_t row_begin, int64_t row_end) {
  const int64_t k_size = p.in_features;
  // Three row blocks or more share a widened tile; fewer widen at each use (Zen 3: 2 blocks ran 0.75-0.85x
  // through the buffer, 6 blocks 1.05-1.2x, 22 blocks 1.15-1.45x).
  const bool widen_per_use = row_end - row_begin <= 2 * kAvx2BlockRows;
  thread_local std::vector<double> wide;
  if (!widen_per_use) wide.resize(static_cast<size_t>(k_size * kPackedCols));
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    if (!widen_per_use) WeightsWidened::widen_tile(p.tile(t), k_size, wide.data());
    for_row_blocks<kAvx2BlockRows>(row_begin, row_end, [&]<int kRows>(int64_t row0) {
      const double* x = x_wide + (row0 - row_begin) * k_size;
      if (widen_per_use) {
        rows_avx2<kRows>(p, t, row0, x, WeightsFromWords{p.tile(t)});
      } else {
        rows_avx2<kRows>(p, t, row0, x, WeightsWidened{wide.data()});
      }
    });
  }
}

#pragma GCC diagnostic pop
#endif

// x_wide: rows [row_begin, row_end) of x as doubles where the AVX2 kernel runs, else null.
void run_tiles(const Float64Problem& p, const double* x_wide, int64_t tile_begin, int64_t tile_end,
               int64_t row_begin, int64_t row_end) {
#if PS_X86_MULTIVERSION
  if (cpu_isa() >= CpuIsa::kAvx512) {  // AMX has no float64 products: its machines run this too
    for (int64_t t = tile_begin; t < tile_end; ++t) {
      for_row_blocks<kAvx512BlockRows>(row_begin, row_end,
                                       [&]<int kRows>(int64_t row0) { block_avx512<kRows>(p, t, row0); });
    }
    return;
  }
  if (cpu_isa() == CpuIsa::kAvx2) {
    tiles_avx2(p, x_wide, tile_begin, tile_end, row_begin, row_end);
    return;
  }
#endif
  (void)x_wide;
  with_cpu_isa([&]() PS_INLINE_BODY {
    for (int64_t t = tile_begin; t < tile_end; ++t) tile_portable(p, t, row_begin, row_end);
  });
}

}  // namespace

void packed_linear_float64_sums(const TensorView& out, const TensorView& x, const TensorView& packed_weight,
                                const std::optional<TensorView>& bias) {
  constexpr std::string_view op = "packed_linear_float64_sums";
  require_tensor_of(op, "x", x, Device::kCPU, 2, DType::kFloat32);
  require_tensor(op, "out", out, Device::kCPU, 2);
  PS_REQUIRE(out.dtype == DType::kFloat32 || out.dtype == DType::kFloat64, op,
             "out must be float32 or float64, got " + out.describe());
  PS_REQUIRE(!(bias && out.dtype == DType::kFloat64), op,
             "bias: a float64 out holds the sums alone (add the bias after rounding to float32)");
  check_packed_linear_operands(op, out, x, packed_weight, bias);
  const int64_t rows = x.size(0), out_features = out.size(1);
  const bool wide = out.dtype == DType::kFloat64;
  const Float64Problem p{x.ptr<float>(),
                         packed_weight.ptr<uint32_t>(),
                         bias ? bias->ptr<float>() : nullptr,
                         wide ? nullptr : out.ptr<float>(),
                         wide ? out.ptr<double>() : nullptr,
                         x.size(1),
                         out_features,
                         packed_k_pairs(x.size(1))};
  const int64_t tiles = packed_col_tiles(out_features);
  const bool widened_x = PS_X86_MULTIVERSION && cpu_isa() == CpuIsa::kAvx2;
  std::vector<double> x_wide;
  for (int64_t row_begin = 0; row_begin < rows; row_begin += kRowChunk) {
    const int64_t row_end = std::min(rows, row_begin + kRowChunk);
    if (widened_x) x_wide.assign(p.x + row_begin * p.in_features, p.x + row_end * p.in_features);
    // Work units (parallel.h): an 8-lane multiply-add is about one, so is streaming one weight.
    const int64_t work_per_tile = ((row_end - row_begin) * 4 + kPackedCols) * p.in_features;
    parallel_for_range(tiles, work_per_tile, [&](int64_t tile_begin, int64_t tile_end) {
      run_tiles(p, widened_x ? x_wide.data() : nullptr, tile_begin, tile_end, row_begin, row_end);
    });
  }
}

}  // namespace pagedserve::ops
