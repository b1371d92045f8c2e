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
// float32 (an FMA per block, in block order). Kernels, chosen at run time (the
// x86 ones in int8_linear_x86.inc):
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

#include "ops/int8_linear_x86.inc"  // the VNNI, AVX2 and AMX kernels

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
