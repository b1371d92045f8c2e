// y = x W^T + b with W as int8 per-output-channel weights (int8_weight_layout.h)
// and x quantized per row on the fly; the weights are never dequantized.
//
// Each row of x is quantized symmetrically: amax = max_k |x[k]|,
// q[k] = round_half_even(x[k] * (127 / amax)) in [-127, 127], scale_x =
// amax / 127, and enters the kernels as u8 = q + 128 (VNNI and AMX multiply
// u8 by s8). The integer part is exact:
//     dot[n] = sum_k (q[k] + 128) qw[n, k] - 128 column_sums[n] = sum_k q[k] qw[n, k]
// and y[n] = float(dot[n]) * (scale_x * scale_w[n]) + bias[n] in float32.
// Kernels, chosen at run time:
//  - amx_int8: one u8 x s8 tile product per 64-deep K chunk (16 x 16 outputs);
//  - avx512_vnni: `vpdpbusd`, 4 products per int32 lane, 64 per instruction;
//  - <level>_int32: integer loops the compiler vectorizes (every other CPU).
// Column tiles are split across threads and no K sum is, so every output is
// the same integer whatever the thread count or the batch.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "ops/cpu_isa.h"
#include "ops/float_types.h"
#include "ops/int8_weight_layout.h"
#include "ops/op_contracts.h"
#include "ops/ops.h"
#include "ops/parallel.h"

namespace pagedserve::ops {
namespace {

constexpr int64_t kRowChunk = 128;  // rows of x kept hot while every weight tile passes over them
constexpr int64_t kAmxRows = 16;    // one AMX tile's rows; x's rows are padded to a multiple
constexpr int kVecRows = 12;        // 2 x 12 accumulators + 2 weight rows + a broadcast < 32 zmm
constexpr int64_t kTileWords = kInt8Cols;

struct Int8Problem {
  const uint8_t* x;          // [round_up(M, 16), K_pad] u8 = q + 128 (128 in the padding)
  const float* x_scale;      // [M] amax / 127
  const int32_t* packed;     // [tiles, k_groups, 16] words of 4 int8 (int8_weight_layout.h)
  const float* scales;       // [N]
  const int32_t* col_sums;   // [N]
  const float* bias;         // [N] or null
  float* out;                // [M, N]
  int64_t rows, out_features, k_groups;

  int64_t k_pad() const { return 4 * k_groups; }
  const int32_t* tile(int64_t t) const { return packed + t * k_groups * kTileWords; }
  const uint8_t* x_row(int64_t row) const { return x + row * k_pad(); }
  int64_t valid_cols(int64_t t) const { return std::min(kInt8Cols, out_features - t * kInt8Cols); }
};

// ---------------------------------------------------------------------------
// x into u8.

// nearbyint (round half to even; roundps from SSE4.1 on): a `(v + 1.5 * 2^23) - 1.5 * 2^23` trick would be
// contracted into an FMA at the AVX2 levels and round x * inv unrounded.
template <typename T>
PS_ALWAYS_INLINE float quantize_row(const T* x, int64_t k_size, uint8_t* dst) {
  float amax = 0.0f;
  for (int64_t k = 0; k < k_size; ++k) amax = std::max(amax, std::fabs(to_float(x[k])));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  for (int64_t k = 0; k < k_size; ++k) {
    const float q = std::clamp(std::nearbyint(to_float(x[k]) * inv), -127.0f, 127.0f);
    dst[k] = static_cast<uint8_t>(static_cast<int32_t>(q) + kInt8ActivationOffset);
  }
  return amax / 127.0f;
}

void quantize_rows(const TensorView& x, int64_t k_groups, std::vector<uint8_t>& q, std::vector<float>& scale) {
  const int64_t rows = x.size(0), k_size = x.size(1), k_pad = 4 * k_groups;
  const int64_t padded_rows = (rows + kAmxRows - 1) / kAmxRows * kAmxRows;
  q.assign(static_cast<size_t>(padded_rows * k_pad), static_cast<uint8_t>(kInt8ActivationOffset));
  scale.assign(static_cast<size_t>(rows), 0.0f);
  for (int64_t row = 0; row < rows; ++row) {
    uint8_t* dst = q.data() + row * k_pad;
    with_cpu_isa([&]() PS_INLINE_BODY {
      scale[static_cast<size_t>(row)] =
          x.dtype == DType::kBFloat16 ? quantize_row(x.ptr<BFloat16>() + row * k_size, k_size, dst)
                                      : quantize_row(x.ptr<float>() + row * k_size, k_size, dst);
    });
  }
}

// ---------------------------------------------------------------------------
// Integer loops (every level without VNNI).

PS_ALWAYS_INLINE void store_scalar(const Int8Problem& p, int64_t t, int64_t row, const int32_t* dot) {
  const int64_t col0 = t * kInt8Cols;
  for (int64_t c = 0; c < p.valid_cols(t); ++c) {
    const int64_t n = col0 + c;
    const int32_t exact = dot[c] - kInt8ActivationOffset * p.col_sums[n];
    const float value = static_cast<float>(exact) * (p.x_scale[row] * p.scales[n]);
    p.out[row * p.out_features + n] = p.bias ? value + p.bias[n] : value;
  }
}

PS_ALWAYS_INLINE void tile_int32(const Int8Problem& p, int64_t t, int64_t row_begin, int64_t row_end) {
  const auto* w = reinterpret_cast<const int8_t*>(p.tile(t));
  for (int64_t row = row_begin; row < row_end; ++row) {
    int32_t dot[kInt8Cols] = {};
    const uint8_t* x = p.x_row(row);
    for (int64_t g = 0; g < p.k_groups; ++g) {
      const int8_t* wg = w + g * kTileWords * 4;
      for (int64_t c = 0; c < kInt8Cols; ++c) {
        int32_t sum = 0;
        for (int64_t j = 0; j < 4; ++j) sum += int32_t{x[4 * g + j]} * int32_t{wg[4 * c + j]};
        dot[c] += sum;
      }
    }
    store_scalar(p, t, row, dot);
  }
}

#if PS_X86_MULTIVERSION
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's AVX-512 headers (see packed_linear.cc)
#pragma GCC diagnostic ignored "-Wuninitialized"

[[gnu::target("arch=x86-64-v4")]] PS_ALWAYS_INLINE void store_row(const Int8Problem& p, int64_t t, int64_t row,
                                                                   __m512i dot) {
  const int64_t valid = p.valid_cols(t);
  const auto mask = static_cast<__mmask16>(valid >= kInt8Cols ? 0xffffu : (1u << valid) - 1u);
  const int64_t col0 = t * kInt8Cols;
  const __m512i sums = _mm512_maskz_loadu_epi32(mask, p.col_sums + col0);
  const __m512i exact = _mm512_sub_epi32(dot, _mm512_slli_epi32(sums, 7));  // 128 column_sums
  const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(p.x_scale[row]), _mm512_maskz_loadu_ps(mask, p.scales + col0));
  __m512 value = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), scale);
  if (p.bias != nullptr) value = _mm512_add_ps(value, _mm512_maskz_loadu_ps(mask, p.bias + col0));
  _mm512_mask_storeu_ps(p.out + row * p.out_features + col0, mask, value);
}

// Rows [row0, row0 + kRows) x column tiles t and t + 1 (t + 1 may be past
// the end: then it is computed from t's weights and not stored).
template <int kRows>
[[gnu::target("arch=x86-64-v4,avx512vnni")]] void block_vnni(const Int8Problem& p, int64_t t, bool pair,
                                                             int64_t row0) {
  const int32_t* w0 = p.tile(t);
  const int32_t* w1 = pair ? p.tile(t + 1) : w0;
  const auto* x = reinterpret_cast<const int32_t*>(p.x_row(row0));  // 4 u8 per word
  const int64_t k_groups = p.k_groups;
  __m512i acc[2][kRows];
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) acc[0][r] = acc[1][r] = _mm512_setzero_si512();
  for (int64_t g = 0; g < k_groups; ++g) {
    const __m512i a = _mm512_loadu_si512(w0 + g * kTileWords);
    const __m512i b = _mm512_loadu_si512(w1 + g * kTileWords);
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) {
      int32_t word;
      std::memcpy(&word, x + r * k_groups + g, sizeof(word));
      const __m512i xr = _mm512_set1_epi32(word);
      acc[0][r] = _mm512_dpbusd_epi32(acc[0][r], xr, a);
      acc[1][r] = _mm512_dpbusd_epi32(acc[1][r], xr, b);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
    store_row(p, t, row0 + r, acc[0][r]);
    if (pair) store_row(p, t + 1, row0 + r, acc[1][r]);
  }
}

template <int kRows = kVecRows>
void block_vnni_dispatch(int rows, const Int8Problem& p, int64_t t, bool pair, int64_t row0) {
  if constexpr (kRows >= 1) {
    if (rows == kRows) return block_vnni<kRows>(p, t, pair, row0);
    return block_vnni_dispatch<kRows - 1>(rows, p, t, pair, row0);
  }
}

void tile_pair_vnni(const Int8Problem& p, int64_t t, int64_t row_begin, int64_t row_end) {
  const bool pair = t + 1 < int8_col_tiles(p.out_features);
  const int64_t rows = row_end - row_begin;
  const int64_t blocks = (rows + kVecRows - 1) / kVecRows;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = row_begin + rows * b / blocks;
    const int64_t end = row_begin + rows * (b + 1) / blocks;
    block_vnni_dispatch(static_cast<int>(end - begin), p, t, pair, begin);
  }
}

// ---------------------------------------------------------------------------
// AMX int8: tiles of 16 rows x 16 columns, K chunks of 64.

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

[[gnu::target("arch=x86-64-v4,amx-tile,amx-int8")]] void configure_tiles() {
  TileConfig config;
  for (int i = 0; i < 8; ++i) {
    config.rows[i] = kAmxRows;
    config.bytes_per_row[i] = 64;
  }
  _tile_loadconfig(&config);
}

// Registers 0-1 even-chunk sums, 2-3 odd-chunk sums (no two consecutive tile
// products on one accumulator), 4-5 x, 6-7 the weights.
[[gnu::target("arch=x86-64-v4,amx-tile,amx-int8")]] void tile_pair_amx(const Int8Problem& p, int64_t row0,
                                                                        int64_t rows, int64_t t, bool pair) {
  constexpr int64_t kChunkWords = (kInt8KChunk / 4) * kTileWords;  // one weight tile register
  const int64_t chunks = 4 * p.k_groups / kInt8KChunk;
  const int64_t x_stride = p.k_pad();
  const uint8_t* x = p.x_row(row0);
  const int32_t* w0 = p.tile(t);
  const int32_t* w1 = pair ? p.tile(t + 1) : w0;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t c = 0; c < chunks; c += 2) {
    _tile_loadd(6, w0 + c * kChunkWords, 64);
    if (pair) _tile_loadd(7, w1 + c * kChunkWords, 64);
    _tile_loadd(4, x + c * kInt8KChunk, x_stride);
    _tile_dpbusd(0, 4, 6);
    if (pair) _tile_dpbusd(1, 4, 7);
    if (c + 1 == chunks) break;
    _tile_loadd(6, w0 + (c + 1) * kChunkWords, 64);
    if (pair) _tile_loadd(7, w1 + (c + 1) * kChunkWords, 64);
    _tile_loadd(5, x + (c + 1) * kInt8KChunk, x_stride);
    _tile_dpbusd(2, 5, 6);
    if (pair) _tile_dpbusd(3, 5, 7);
  }
  alignas(64) int32_t acc[4][kAmxRows][kInt8Cols];
  _tile_stored(0, acc[0], 64);
  _tile_stored(2, acc[2], 64);
  if (pair) {
    _tile_stored(1, acc[1], 64);
    _tile_stored(3, acc[3], 64);
  }
  for (int64_t r = 0; r < rows; ++r) {
    store_row(p, t, row0 + r, _mm512_add_epi32(_mm512_load_si512(acc[0][r]), _mm512_load_si512(acc[2][r])));
    if (pair) {
      store_row(p, t + 1, row0 + r, _mm512_add_epi32(_mm512_load_si512(acc[1][r]), _mm512_load_si512(acc[3][r])));
    }
  }
}

[[gnu::target("arch=x86-64-v4,amx-tile,amx-int8")]] void run_pairs_amx(const Int8Problem& p, int64_t pair_begin,
                                                                        int64_t pair_end, int64_t row_begin,
                                                                        int64_t row_end) {
  configure_tiles();
  const int64_t tiles = int8_col_tiles(p.out_features);
  for (int64_t pair = pair_begin; pair < pair_end; ++pair) {
    for (int64_t row0 = row_begin; row0 < row_end; row0 += kAmxRows) {
      tile_pair_amx(p, row0, std::min(kAmxRows, row_end - row0), 2 * pair, 2 * pair + 1 < tiles);
    }
  }
  _tile_release();
}

#pragma GCC diagnostic pop
#endif

void run_pairs(const Int8Problem& p, int64_t pair_begin, int64_t pair_end, int64_t row_begin, int64_t row_end) {
#if PS_X86_MULTIVERSION
  if (cpu_has_amx_int8()) return run_pairs_amx(p, pair_begin, pair_end, row_begin, row_end);
  if (cpu_has_avx512_vnni()) {
    for (int64_t pair = pair_begin; pair < pair_end; ++pair) tile_pair_vnni(p, 2 * pair, row_begin, row_end);
    return;
  }
#endif
  const int64_t tile_end = std::min(int8_col_tiles(p.out_features), 2 * pair_end);
  with_cpu_isa([&]() PS_INLINE_BODY {
    for (int64_t t = 2 * pair_begin; t < tile_end; ++t) tile_int32(p, t, row_begin, row_end);
  });
}

void check_int8_linear(const TensorView& out, const TensorView& x, const TensorView& packed,
                       const TensorView& scales, const TensorView& column_sums, const std::optional<TensorView>& bias) {
  constexpr std::string_view op = "int8_linear";
  require_float_tensor(op, "x", x, Device::kCPU, 2);
  PS_REQUIRE(x.dtype != DType::kFloat16, op, "x must be float32 or bfloat16, got float16");
  require_tensor_of(op, "out", out, Device::kCPU, 2, DType::kFloat32);
  const int64_t out_features = out.size(1);
  require_size(op, "out", out, 0, x.size(0));
  require_tensor_of(op, "packed_weight", packed, Device::kCPU, 3, DType::kInt32);
  require_size(op, "packed_weight", packed, 0, int8_col_tiles(out_features));
  require_size(op, "packed_weight", packed, 1, int8_k_groups(x.size(1)));
  require_size(op, "packed_weight", packed, 2, kInt8Cols);
  require_tensor_of(op, "scales", scales, Device::kCPU, 1, DType::kFloat32);
  require_size(op, "scales", scales, 0, out_features);
  require_tensor_of(op, "column_sums", column_sums, Device::kCPU, 1, DType::kInt32);
  require_size(op, "column_sums", column_sums, 0, out_features);
  if (bias) {
    require_tensor_of(op, "bias", *bias, Device::kCPU, 1, DType::kFloat32);
    require_size(op, "bias", *bias, 0, out_features);
  }
}

}  // namespace

void int8_linear(const TensorView& out, const TensorView& x, const TensorView& packed_weight,
                 const TensorView& scales, const TensorView& column_sums, const std::optional<TensorView>& bias) {
  check_int8_linear(out, x, packed_weight, scales, column_sums, bias);
  const int64_t rows = x.size(0), out_features = out.size(1), k_groups = int8_k_groups(x.size(1));
  thread_local std::vector<uint8_t> xq;  // the caller's; workers only read them during the call
  thread_local std::vector<float> x_scale;
  quantize_rows(x, k_groups, xq, x_scale);
  const Int8Problem p{xq.data(), x_scale.data(), packed_weight.ptr<int32_t>(), scales.ptr<float>(),
                      column_sums.ptr<int32_t>(), bias ? bias->ptr<float>() : nullptr, out.ptr<float>(),
                      rows, out_features, k_groups};
  const int64_t pairs = (int8_col_tiles(out_features) + 1) / 2;
  for (int64_t row_begin = 0; row_begin < rows; row_begin += kRowChunk) {
    const int64_t row_end = std::min(rows, row_begin + kRowChunk);
    // Work units (parallel.h): a 64-lane vpdpbusd is about one, so is streaming 4 weights.
    const int64_t work_per_pair = 2 * ((row_end - row_begin) + kInt8Cols) * k_groups;
    parallel_for_range(pairs, work_per_pair, [&](int64_t pair_begin, int64_t pair_end) {
      run_pairs(p, pair_begin, pair_end, row_begin, row_end);
    });
  }
}

std::string_view int8_linear_kernel() {
  if (cpu_has_amx_int8()) return "amx_int8";
  if (cpu_has_avx512_vnni()) return "avx512_vnni";
  switch (cpu_isa()) {
    case CpuIsa::kAmx:
    case CpuIsa::kAvx512Bf16:
    case CpuIsa::kAvx512: return "avx512_int32";
    case CpuIsa::kAvx2: return "avx2_int32";
    case CpuIsa::kBaseline: break;
  }
  return "baseline_int32";
}

}  // namespace pagedserve::ops
