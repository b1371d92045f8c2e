// y = x W^T + b with W as int8 per-output-channel weights (int8_weight_layout.h)
// and x quantized on the fly; the weights are never dequantized.
//
// Each 64-block b of a row of x is quantized symmetrically: amax_b = max
// |x[k]| over the block, q[k] = round_half_even(x[k] * (127 / amax_b)) in
// [-127, 127], scale_b = amax_b / 127 (a block keeps one outlier channel from
// flattening the rest of its row: per-row scales lost half the greedy tokens
// of SmolLM2-135M, per-block ones a fifth). The kernels multiply s8 q by u8
// weights qw + 128, and each block's integer sum is exact:
//     dot_b[n] = sum_{k in b} q[k] (qw[n, k] + 128) - 128 sum_{k in b} q[k]
// then y[n] = (sum_b float(dot_b[n]) * scale_b) * scale_w[n] + bias[n] in
// float32 (an FMA per block, in block order). Kernels, chosen at run time:
//  - amx_int8: one s8 x u8 tile product per block (16 x 16 outputs), from
//    kAmxMinRows rows of x; fewer rows run avx512_vnni, which gives the same bits;
//  - avx512_vnni: `vpdpbusd`, 4 products per int32 lane, 64 per instruction;
//  - avx2_maddubs (AVX2 without VNNI: Zen 3, Haswell and later): the same 4
//    products per lane from vpmaddubsw + vpmaddwd. vpmaddubsw adds pairs in
//    int16 with saturation, which u8 weights up to 255 could reach, so the
//    weights are taken back to signed q (w ^ 0x80) and multiplied as
//    |q| x sign(q) x (at most 2 x 127 x 127 a pair): the lanes hold
//    sum q x, which is dot_b - 128 sum x exactly, and every float step after
//    is vpdpbusd's;
//  - <level>_int32: integer loops the compiler vectorizes (every other CPU).
// Column tiles are split across threads and no K sum is, so every output is
// the same whatever the thread count or the batch.
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
#include "ops/int8_activations.h"
#include "ops/int8_weight_layout.h"
#include "ops/op_contracts.h"
#include "ops/ops.h"
#include "ops/parallel.h"
#include "ops/tile_kernel_driver.h"

namespace pagedserve::ops {
namespace {

constexpr int64_t kRowChunk = 128;  // rows of x kept hot while every weight tile passes over them
constexpr int64_t kAmxRows = 16;    // one AMX tile's rows; x's rows are padded to a multiple
constexpr int kVecRows = 6;         // 2 x 6 int32 + 2 x 6 float accumulators + 2 weight rows + x < 32 zmm
// AMX's tiles from this many rows of x on; below, one register block of the VNNI kernel holds every
// row and each weight passes through it once. Intel host (family 6 model 207, 2 pinned cores, cold
// weights): batch-1 int8 decode 96 tok/s on AMX, 139 on VNNI; at 16 rows AMX leads (485 vs 405).
// Both give the same bits (exact integer sums, the same float steps), so the switch never changes
// a row's result.
constexpr int64_t kAmxMinRows = kVecRows + 1;
constexpr int64_t kTileWords = kInt8Cols;

struct Int8Problem {
  const int8_t* x;          // [round_up(M, 16), K_pad] s8 (0 in the padding)
  const float* x_scale;     // [M, blocks] amax_b / 127
  const int32_t* x_offset;  // [M, blocks] 128 sum_{k in b} q[k]
  const int32_t* packed;    // [tiles, k_groups, 16] words of 4 u8 (int8_weight_layout.h)
  const float* scales;      // [N]
  const float* bias;        // [N] or null
  float* out;               // [M, N]
  int64_t rows, out_features, k_groups;

  int64_t k_pad() const { return 4 * k_groups; }
  int64_t blocks() const { return k_groups / kInt8BlockGroups; }
  const int32_t* tile(int64_t t) const { return packed + t * k_groups * kTileWords; }
  const int8_t* x_row(int64_t row) const { return x + row * k_pad(); }
  int64_t valid_cols(int64_t t) const { return std::min(kInt8Cols, out_features - t * kInt8Cols); }
};

// ---------------------------------------------------------------------------
// Integer loops (every level without VNNI).

PS_ALWAYS_INLINE void tile_int32(const Int8Problem& p, int64_t t, int64_t row_begin, int64_t row_end) {
  const auto* w = reinterpret_cast<const uint8_t*>(p.tile(t));
  const int64_t blocks = p.blocks(), col0 = t * kInt8Cols;
  for (int64_t row = row_begin; row < row_end; ++row) {
    float acc[kInt8Cols] = {};
    const int8_t* x = p.x_row(row);
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t dot[kInt8Cols] = {};
      for (int64_t g = b * kInt8BlockGroups; g < (b + 1) * kInt8BlockGroups; ++g) {
        const uint8_t* wg = w + g * kTileWords * 4;
        for (int64_t c = 0; c < kInt8Cols; ++c) {
          int32_t sum = 0;
          for (int64_t j = 0; j < 4; ++j) sum += int32_t{x[4 * g + j]} * int32_t{wg[4 * c + j]};
          dot[c] += sum;
        }
      }
      const float scale = p.x_scale[row * blocks + b];
      const int32_t offset = p.x_offset[row * blocks + b];
      for (int64_t c = 0; c < kInt8Cols; ++c) acc[c] += static_cast<float>(dot[c] - offset) * scale;
    }
    for (int64_t c = 0; c < p.valid_cols(t); ++c) {
      const float value = acc[c] * p.scales[col0 + c];
      p.out[row * p.out_features + col0 + c] = p.bias ? value + p.bias[col0 + c] : value;
    }
  }
}

#if PS_X86_MULTIVERSION
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's AVX-512 headers (see packed_linear.cc)
#pragma GCC diagnostic ignored "-Wuninitialized"

[[gnu::target("arch=x86-64-v4")]] PS_ALWAYS_INLINE void store_row(const Int8Problem& p, int64_t t, int64_t row,
                                                                   __m512 acc) {
  const int64_t valid = p.valid_cols(t);
  const auto mask = static_cast<__mmask16>(valid >= kInt8Cols ? 0xffffu : (1u << valid) - 1u);
  const int64_t col0 = t * kInt8Cols;
  __m512 value = _mm512_mul_ps(acc, _mm512_maskz_loadu_ps(mask, p.scales + col0));
  if (p.bias != nullptr) value = _mm512_add_ps(value, _mm512_maskz_loadu_ps(mask, p.bias + col0));
  _mm512_mask_storeu_ps(p.out + row * p.out_features + col0, mask, value);
}

// acc += float(dot - offset) * scale for one row's block.
[[gnu::target("arch=x86-64-v4")]] PS_ALWAYS_INLINE __m512 fold_block(const Int8Problem& p, int64_t row, int64_t b,
                                                                      __m512i dot, __m512 acc) {
  const int64_t at = row * p.blocks() + b;
  const __m512i exact = _mm512_sub_epi32(dot, _mm512_set1_epi32(p.x_offset[at]));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(p.x_scale[at]), acc);
}

// Rows [row0, row0 + kRows) x column tiles t and t + 1 (t + 1 may be past
// the end: then it is computed from t's weights and not stored).
template <int kRows>
[[gnu::target("arch=x86-64-v4,avx512vnni")]] void block_vnni(const Int8Problem& p, int64_t t, bool pair,
                                                             int64_t row0) {
  const int32_t* w0 = p.tile(t);
  const int32_t* w1 = pair ? p.tile(t + 1) : w0;
  const int8_t* x = p.x_row(row0);
  const int64_t k_pad = p.k_pad();
  __m512 acc[2][kRows];
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.blocks(); ++b) {
    __m512i dot[2][kRows];
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) dot[0][r] = dot[1][r] = _mm512_setzero_si512();
    for (int64_t g = b * kInt8BlockGroups; g < (b + 1) * kInt8BlockGroups; ++g) {
      const __m512i a = _mm512_loadu_si512(w0 + g * kTileWords);
      const __m512i c = _mm512_loadu_si512(w1 + g * kTileWords);
#pragma GCC unroll 16
      for (int r = 0; r < kRows; ++r) {
        int32_t word;  // x[4g .. 4g + 3] of row r
        std::memcpy(&word, x + r * k_pad + 4 * g, sizeof(word));
        const __m512i xr = _mm512_set1_epi32(word);
        dot[0][r] = _mm512_dpbusd_epi32(dot[0][r], a, xr);
        dot[1][r] = _mm512_dpbusd_epi32(dot[1][r], c, xr);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) {
      acc[0][r] = fold_block(p, row0 + r, b, dot[0][r], acc[0][r]);
      acc[1][r] = fold_block(p, row0 + r, b, dot[1][r], acc[1][r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
    store_row(p, t, row0 + r, acc[0][r]);
    if (pair) store_row(p, t + 1, row0 + r, acc[1][r]);
  }
}

// ---------------------------------------------------------------------------
// AVX2: one column tile as two 8-lane halves, up to kAvx2Rows rows of x.

constexpr int kAvx2Rows = 2;  // 2 x 2 int32 + 2 x 2 float accumulators + 4 weight vectors + x, sign < 16 ymm

// The 32 bytes of 8 columns' words as |q| and q (signed: the stored u8 is q + 128).
struct SignedWeights {
  __m256i magnitude;
  __m256i sign;
};

[[gnu::target("arch=x86-64-v3")]] PS_ALWAYS_INLINE SignedWeights signed_weights(const int32_t* words) {
  const __m256i q = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(words)),
                                     _mm256_set1_epi8(static_cast<char>(0x80)));
  return {_mm256_abs_epi8(q), q};
}

// dot + sum over each lane's 4 bytes of q x (no saturation: |q|, |x| <= 127).
[[gnu::target("arch=x86-64-v3")]] PS_ALWAYS_INLINE __m256i dot_q(__m256i dot, const SignedWeights& w, __m256i x) {
  return _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(w.magnitude, _mm256_sign_epi8(x, w.sign)),
                                                 _mm256_set1_epi16(1)));
}

// out[row, tile t] = acc * scales (+ bias), as store_row: a multiply, then an add.
[[gnu::target("arch=x86-64-v3")]] PS_ALWAYS_INLINE void store_row_avx2(const Int8Problem& p, int64_t t, int64_t row,
                                                                        const __m256 (&acc)[2]) {
  const int64_t col0 = t * kInt8Cols;
  alignas(32) float values[kInt8Cols];
  for (int h = 0; h < 2; ++h) _mm256_store_ps(values + 8 * h, acc[h]);
  for (int64_t c = 0; c < p.valid_cols(t); ++c) {
    const float value = values[c] * p.scales[col0 + c];
    p.out[row * p.out_features + col0 + c] = p.bias ? value + p.bias[col0 + c] : value;
  }
}

template <int kRows>
[[gnu::target("arch=x86-64-v3")]] void block_avx2(const Int8Problem& p, int64_t t, int64_t row0) {
  const int32_t* words = p.tile(t);
  const int8_t* x = p.x_row(row0);
  const int64_t k_pad = p.k_pad();
  __m256 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < p.blocks(); ++b) {
    __m256i dot[kRows][2];
    for (int r = 0; r < kRows; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int64_t g = b * kInt8BlockGroups; g < (b + 1) * kInt8BlockGroups; ++g) {
      const SignedWeights w[2] = {signed_weights(words + g * kTileWords), signed_weights(words + g * kTileWords + 8)};
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        int32_t word;  // x[4g .. 4g + 3] of row r
        std::memcpy(&word, x + r * k_pad + 4 * g, sizeof(word));
        const __m256i xr = _mm256_set1_epi32(word);
        dot[r][0] = dot_q(dot[r][0], w[0], xr);
        dot[r][1] = dot_q(dot[r][1], w[1], xr);
      }
    }
    for (int r = 0; r < kRows; ++r) {  // fold_block's steps; the lanes already hold dot - offset
      const __m256 scale = _mm256_set1_ps(p.x_scale[(row0 + r) * p.blocks() + b]);
      for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), scale, acc[r][h]);
    }
  }
  for (int r = 0; r < kRows; ++r) store_row_avx2(p, t, row0 + r, acc[r]);
}

void tile_pair_vnni(const Int8Problem& p, int64_t t, int64_t row_begin, int64_t row_end) {
  const bool pair = t + 1 < int8_col_tiles(p.out_features);
  for_row_blocks<kVecRows>(row_begin, row_end, [&]<int kRows>(int64_t row0) { block_vnni<kRows>(p, t, pair, row0); });
}

// ---------------------------------------------------------------------------
// AMX int8: tiles of 16 rows x 16 columns, K chunks of 64.

// One block (64 of K) per tile product, s8 x times u8 weights; each block's
// int32 sums leave the tile registers to be scaled into float accumulators.
// Registers 0-1 the two column tiles' sums, 4 x, 6-7 the weights.
[[gnu::target("arch=x86-64-v4,amx-tile,amx-int8")]] void tile_pair_amx(const Int8Problem& p, int64_t row0,
                                                                        int64_t rows, int64_t t, bool pair) {
  constexpr int64_t kChunkWords = kInt8BlockGroups * kTileWords;  // one weight tile register
  const int8_t* x = p.x_row(row0);
  const int32_t* w[2] = {p.tile(t), pair ? p.tile(t + 1) : p.tile(t)};
  alignas(64) int32_t dot[2][kAmxRows][kInt8Cols];
  __m512 acc[2][kAmxRows];
  for (int64_t r = 0; r < kAmxRows; ++r) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.blocks(); ++b) {
    prefetch_weight_chunk(w[0] + (b + kAmxPrefetchChunks) * kChunkWords);  // past the end: the next tile's
    if (pair) prefetch_weight_chunk(w[1] + (b + kAmxPrefetchChunks) * kChunkWords);
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(4, x + b * kInt8KChunk, p.k_pad());
    _tile_loadd(6, w[0] + b * kChunkWords, 64);
    _tile_dpbsud(0, 4, 6);
    _tile_stored(0, dot[0], 64);
    if (pair) {
      _tile_loadd(7, w[1] + b * kChunkWords, 64);
      _tile_dpbsud(1, 4, 7);
      _tile_stored(1, dot[1], 64);
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int i = 0; i < (pair ? 2 : 1); ++i) {
        acc[i][r] = fold_block(p, row0 + r, b, _mm512_load_si512(dot[i][r]), acc[i][r]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    store_row(p, t, row0 + r, acc[0][r]);
    if (pair) store_row(p, t + 1, row0 + r, acc[1][r]);
  }
}

void run_pairs_amx(const Int8Problem& p, int64_t pair_begin, int64_t pair_end, int64_t row_begin, int64_t row_end) {
  for_amx_tile_pairs(int8_col_tiles(p.out_features), pair_begin, pair_end, row_begin, row_end,
                     [&](int64_t row0, int64_t rows, int64_t t, bool pair) { tile_pair_amx(p, row0, rows, t, pair); });
}

#pragma GCC diagnostic pop
#endif

void run_pairs(const Int8Problem& p, int64_t pair_begin, int64_t pair_end, int64_t row_begin, int64_t row_end) {
#if PS_X86_MULTIVERSION
  if (cpu_has_amx_int8() && p.rows >= kAmxMinRows) return run_pairs_amx(p, pair_begin, pair_end, row_begin, row_end);
  if (cpu_has_avx512_vnni()) {
    for (int64_t pair = pair_begin; pair < pair_end; ++pair) tile_pair_vnni(p, 2 * pair, row_begin, row_end);
    return;
  }
#endif
  const int64_t tile_end = std::min(int8_col_tiles(p.out_features), 2 * pair_end);
#if PS_X86_MULTIVERSION
  if (cpu_isa() >= CpuIsa::kAvx2) {
    for (int64_t t = 2 * pair_begin; t < tile_end; ++t) {
      for_row_blocks<kAvx2Rows>(row_begin, row_end, [&]<int kRows>(int64_t row0) { block_avx2<kRows>(p, t, row0); });
    }
    return;
  }
#endif
  with_cpu_isa([&]() PS_INLINE_BODY {
    for (int64_t t = 2 * pair_begin; t < tile_end; ++t) tile_int32(p, t, row_begin, row_end);
  });
}

void check_int8_linear(const TensorView& out, const TensorView& x, const TensorView& packed,
                       const TensorView& scales, const std::optional<TensorView>& bias) {
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
  if (bias) {
    require_tensor_of(op, "bias", *bias, Device::kCPU, 1, DType::kFloat32);
    require_size(op, "bias", *bias, 0, out_features);
  }
}

}  // namespace

void int8_linear(const TensorView& out, const TensorView& x, const TensorView& packed_weight,
                 const TensorView& scales, const std::optional<TensorView>& bias) {
  check_int8_linear(out, x, packed_weight, scales, bias);
  const int64_t rows = x.size(0), out_features = out.size(1), k_groups = int8_k_groups(x.size(1));
  thread_local Int8Rows xq;  // the caller's; workers only read it during the call
  quantize_int8_rows(x, k_groups, xq);
  const Int8Problem p{xq.values.data(), xq.scale.data(), xq.offset.data(), packed_weight.ptr<int32_t>(),
                      scales.ptr<float>(), bias ? bias->ptr<float>() : nullptr, out.ptr<float>(),
                      rows, out_features, k_groups};
  const int64_t pairs = (int8_col_tiles(out_features) + 1) / 2;
  for (int64_t row_begin = 0; row_begin < rows; row_begin += kRowChunk) {
    const int64_t row_end = std::min(rows, row_begin + kRowChunk);
    // Work units (parallel.h): a 64-lane vpdpbusd is about one, and so is streaming one weight (as
    // packed_linear counts it: a decode step's weights come from DRAM, slower than a cached stream).
    const int64_t work_per_pair = 2 * ((row_end - row_begin) + 4 * kInt8Cols) * k_groups;
    parallel_for_range(pairs, work_per_pair, [&](int64_t pair_begin, int64_t pair_end) {
      run_pairs(p, pair_begin, pair_end, row_begin, row_end);
    });
  }
}

std::string_view int8_linear_kernel() {
  if (cpu_has_amx_int8()) {
    static const std::string name = "amx_int8 (avx512_vnni below " + std::to_string(kAmxMinRows) + " rows)";
    return name;
  }
  if (cpu_has_avx512_vnni()) return "avx512_vnni";
  switch (cpu_isa()) {
    case CpuIsa::kAmx:
    case CpuIsa::kAvx512Bf16:
    case CpuIsa::kAvx512:
    case CpuIsa::kAvx2: return "avx2_maddubs";
    case CpuIsa::kBaseline: break;
  }
  return "baseline_int32";
}

}  // namespace pagedserve::ops
