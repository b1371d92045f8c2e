// y = x W^T + b with float32 activations and W stored bf16 in the packed
// layout of packed_weight_layout.h (see there for why).
//
// Three kernels, one result up to summation order (the x86 ones in
// packed_linear_x86.inc):
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

#include "ops/packed_linear_x86.inc"  // the AVX-512, AVX2 and AMX kernels

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
