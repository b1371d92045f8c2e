// y = x W^T over GGUF blocks (gguf_ops.h), float32 arithmetic.
//
// The weight is never dequantized as a whole: output rows are taken
// kTileRows at a time, their blocks decoded into a float buffer that stays in
// L1 (4 rows x K floats: 9 KiB at K = 576, 24 KiB at K = 1536), and every row
// of x passes over that buffer before the next tile is decoded. So a decode
// step (M = 1) reads each weight byte once from memory, and a prefill decodes
// each tile once per kRowChunk rows of x rather than once per row. These
// float32 kernels keep the result within float32 rounding of the dequantized
// matrix product; they run every format below the AVX2 level. At AVX2 and
// above, every format takes gguf_int8.h's int8-activation kernels instead,
// for every M (batch invariant), over the file's layout or the interleaved
// one loading makes (gguf_interleaved.h).
//
// Kernels: the decoders are gguf_blocks.h's loops, compiled per ISA level;
// the dot products run as AVX-512 FMAs (4 rows of x x 4 weight rows = 16
// accumulators) or as portable 16-lane loops. Tiles are split across
// threads; each output is computed by one thread in a fixed order, so the
// thread count never changes a bit of the result.
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "ops/cpu_isa.h"
#include "ops/gguf_blocks.h"
#include "ops/gguf_checks.h"
#include "ops/gguf_decode_avx512.h"
#include "ops/gguf_int8.h"
#include "ops/gguf_interleaved.h"
#include "ops/gguf_ops.h"
#include "ops/op_contracts.h"
#include "ops/parallel.h"

namespace pagedserve::ops {
namespace {

using gguf::BlockFormat;
using gguf::BlockType;

constexpr int kTileRows = 4;      // weight rows decoded together
constexpr int kXRows = 4;         // rows of x per register block
constexpr int kLanes = 16;        // K is a multiple of 32, so of 16
constexpr int64_t kRowChunk = 64;  // rows of x kept in L2 while the tiles pass (64 x 1536 floats = 384 KiB)

struct GgufProblem : gguf::LinearArgs {
  int64_t row_blocks;  // K / block_elems

  int64_t tiles() const { return (out_features + kTileRows - 1) / kTileRows; }
  int64_t tile_rows(int64_t t) const { return std::min<int64_t>(kTileRows, out_features - t * kTileRows); }
  void store(int64_t m, int64_t n, float sum) const { out[m * out_stride + n] = sum + (bias ? bias[n] : 0.0f); }
};

// Decodes tile t into w [kTileRows, K] with decode(row blocks, count, out); rows past N are zero.
template <typename Decode>
PS_ALWAYS_INLINE void decode_tile(const GgufProblem& p, int64_t t, float* w, Decode decode) {
  const int64_t valid = p.tile_rows(t);
  for (int64_t r = 0; r < valid; ++r) {
    decode(p.blocks + (t * kTileRows + r) * p.row_bytes, p.row_blocks, w + r * p.in_features);
  }
  std::fill(w + valid * p.in_features, w + kTileRows * p.in_features, 0.0f);
}

// Rows [m0, m0 + kM) of x against a decoded tile, portable: 16 partial sums
// per output, added in a fixed order.
template <int kM>
PS_ALWAYS_INLINE void dot_tile_portable(const GgufProblem& p, const float* w, int64_t t, int64_t m0) {
  const int64_t k_size = p.in_features;
  float acc[kM][kTileRows][kLanes] = {};
  for (int64_t k = 0; k < k_size; k += kLanes) {
    for (int m = 0; m < kM; ++m) {
      const float* x = p.x + (m0 + m) * k_size + k;
      for (int r = 0; r < kTileRows; ++r) {
        const float* wr = w + r * k_size + k;
        for (int l = 0; l < kLanes; ++l) acc[m][r][l] += x[l] * wr[l];
      }
    }
  }
  for (int m = 0; m < kM; ++m) {
    for (int64_t r = 0; r < p.tile_rows(t); ++r) {
      float sum = 0.0f;
      for (int l = 0; l < kLanes; ++l) sum += acc[m][r][l];
      p.store(m0 + m, t * kTileRows + r, sum);
    }
  }
}

template <int kM = kXRows>
PS_ALWAYS_INLINE void dot_rows_portable(int rows, const GgufProblem& p, const float* w, int64_t t, int64_t m0) {
  if constexpr (kM >= 1) {
    if (rows == kM) return dot_tile_portable<kM>(p, w, t, m0);
    return dot_rows_portable<kM - 1>(rows, p, w, t, m0);
  }
}

template <BlockType kType>
void run_tiles_portable(const GgufProblem& p, int64_t tile_begin, int64_t tile_end, int64_t row_begin,
                        int64_t row_end, float* w) {
  with_cpu_isa([&]() PS_INLINE_BODY {
    for (int64_t t = tile_begin; t < tile_end; ++t) {
      decode_tile(p, t, w, [](const uint8_t* b, int64_t n, float* o) PS_INLINE_BODY {
        gguf::decode_blocks<kType>(b, n, o);
      });
      for (int64_t m0 = row_begin; m0 < row_end; m0 += kXRows) {
        dot_rows_portable(static_cast<int>(std::min<int64_t>(kXRows, row_end - m0)), p, w, t, m0);
      }
    }
  });
}

#if PS_X86_MULTIVERSION
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's AVX-512 headers (see packed_linear_x86.inc)

template <int kM>
[[gnu::target("arch=x86-64-v4")]] PS_ALWAYS_INLINE void dot_tile_avx512(const GgufProblem& p, const float* w,
                                                                         int64_t t, int64_t m0) {
  const int64_t k_size = p.in_features;
  __m512 acc[kM][kTileRows];
#pragma GCC unroll 16
  for (int m = 0; m < kM; ++m) {
#pragma GCC unroll 4
    for (int r = 0; r < kTileRows; ++r) acc[m][r] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < k_size; k += kLanes) {
    __m512 wv[kTileRows];
#pragma GCC unroll 4
    for (int r = 0; r < kTileRows; ++r) wv[r] = _mm512_loadu_ps(w + r * k_size + k);
#pragma GCC unroll 4
    for (int m = 0; m < kM; ++m) {
      const __m512 xv = _mm512_loadu_ps(p.x + (m0 + m) * k_size + k);
#pragma GCC unroll 4
      for (int r = 0; r < kTileRows; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < kM; ++m) {
    for (int64_t r = 0; r < p.tile_rows(t); ++r) p.store(m0 + m, t * kTileRows + r, _mm512_reduce_add_ps(acc[m][r]));
  }
}

template <int kM = kXRows>
[[gnu::target("arch=x86-64-v4")]] PS_ALWAYS_INLINE void dot_rows_avx512(int rows, const GgufProblem& p,
                                                                         const float* w, int64_t t, int64_t m0) {
  if constexpr (kM >= 1) {
    if (rows == kM) return dot_tile_avx512<kM>(p, w, t, m0);
    return dot_rows_avx512<kM - 1>(rows, p, w, t, m0);
  }
}

// One row of x (a decode step) against tile t of a 32-weight format: each block is decoded into
// registers and multiplied straight away, never stored. The sums run in the order dot_tile_avx512
// adds them (lane l of row r accumulates k = 16 j + l, j ascending), so results do not depend on
// which path ran.
template <BlockType kType>
[[gnu::target("arch=x86-64-v4")]] void row_tile_avx512(const GgufProblem& p, int64_t t, int64_t m) {
  const float* x = p.x + m * p.in_features;
  const int64_t valid = p.tile_rows(t);
  const uint8_t* rows[kTileRows];
  for (int r = 0; r < kTileRows; ++r) {  // rows past N repeat the last one and are not stored
    rows[r] = p.blocks + (t * kTileRows + std::min<int64_t>(r, valid - 1)) * p.row_bytes;
  }
  __m512 acc[kTileRows];
#pragma GCC unroll 4
  for (int r = 0; r < kTileRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < p.row_blocks; ++blk) {
    const __m512 x0 = _mm512_loadu_ps(x + 32 * blk);
    const __m512 x1 = _mm512_loadu_ps(x + 32 * blk + 16);
#pragma GCC unroll 4
    for (int r = 0; r < kTileRows; ++r) {
      __m512 w0, w1;
      gguf::load_block32_avx512<kType>(rows[r], blk, w0, w1);
      acc[r] = _mm512_fmadd_ps(x0, w0, acc[r]);
      acc[r] = _mm512_fmadd_ps(x1, w1, acc[r]);
    }
  }
  for (int64_t r = 0; r < valid; ++r) p.store(m, t * kTileRows + r, _mm512_reduce_add_ps(acc[r]));
}

template <BlockType kType>
[[gnu::target("arch=x86-64-v4")]] void run_tiles_avx512(const GgufProblem& p, int64_t tile_begin, int64_t tile_end,
                                                        int64_t row_begin, int64_t row_end, float* w) {
  if constexpr (gguf::kBlock32<kType>) {
    if (row_end - row_begin == 1) {  // decode: nothing to reuse a decoded tile for
      for (int64_t t = tile_begin; t < tile_end; ++t) row_tile_avx512<kType>(p, t, row_begin);
      return;
    }
  }
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    const int64_t valid = p.tile_rows(t);  // decode_tile, with the AVX-512 decoders
    for (int64_t r = 0; r < valid; ++r) {
      gguf::decode_blocks_avx512<kType>(p.blocks + (t * kTileRows + r) * p.row_bytes, p.row_blocks,
                                        w + r * p.in_features);
    }
    std::fill(w + valid * p.in_features, w + kTileRows * p.in_features, 0.0f);
    for (int64_t m0 = row_begin; m0 < row_end; m0 += kXRows) {
      dot_rows_avx512(static_cast<int>(std::min<int64_t>(kXRows, row_end - m0)), p, w, t, m0);
    }
  }
}

#pragma GCC diagnostic pop
#endif

template <BlockType kType>
void run_tiles(const GgufProblem& p, int64_t tile_begin, int64_t tile_end, int64_t row_begin, int64_t row_end,
               float* w) {
#if PS_X86_MULTIVERSION
  if (cpu_isa() >= CpuIsa::kAvx512) return run_tiles_avx512<kType>(p, tile_begin, tile_end, row_begin, row_end, w);
#endif
  run_tiles_portable<kType>(p, tile_begin, tile_end, row_begin, row_end, w);
}

template <BlockType kType>
void run_linear(const GgufProblem& p) {
  // Work units (parallel.h): decoding a weight is about one, so is a 16-lane multiply-add.
  const int64_t work_per_tile = kTileRows * p.in_features * (1 + p.rows / kLanes + 1);
  parallel_for_range(p.tiles(), work_per_tile, [&](int64_t tile_begin, int64_t tile_end) {
    std::vector<float> w(static_cast<size_t>(kTileRows * p.in_features));
    for (int64_t row_begin = 0; row_begin < p.rows; row_begin += kRowChunk) {
      run_tiles<kType>(p, tile_begin, tile_end, row_begin, std::min(p.rows, row_begin + kRowChunk), w.data());
    }
  });
}

void run_float32(const gguf::LinearArgs& args, const BlockFormat& format) {
  const GgufProblem p{args, args.in_features / format.elems};
  gguf::dispatch_block_type(format.type, [&]<BlockType kType>() { run_linear<kType>(p); });
}

// Interleaved blocks: the int8-activation kernels' own layout. Below the AVX2 level (a test that
// lowered it after loading) each 64 rows go back to the file's layout for the float32 kernels.
void run_interleaved(const gguf::LinearArgs& args, const BlockFormat& format) {
  if (gguf::int8_activations_apply(format.type)) return gguf::linear_int8_interleaved(format.type, args);
  constexpr int64_t kChunkGroups = 8;
  const int64_t groups = args.out_features / gguf::kInterleavedRows;
  const int64_t group_bytes = gguf::kInterleavedRows * args.row_bytes;
  std::vector<uint8_t> rows(static_cast<size_t>(kChunkGroups * group_bytes));
  for (int64_t g0 = 0; g0 < groups; g0 += kChunkGroups) {
    const int64_t count = std::min(kChunkGroups, groups - g0);
    const int64_t first = g0 * gguf::kInterleavedRows;
    gguf::deinterleave_groups(format.type, args.blocks + g0 * group_bytes, rows.data(), count, args.row_bytes);
    gguf::LinearArgs part = args;
    part.blocks = rows.data();
    part.bias = args.bias ? args.bias + first : nullptr;
    part.out = args.out + first;
    part.out_features = count * gguf::kInterleavedRows;
    run_float32(part, format);
  }
}

}  // namespace

void gguf_linear(const TensorView& out, const TensorView& x, const TensorView& blocks, int64_t type,
                 const std::optional<TensorView>& bias) {
  constexpr std::string_view op = "gguf_linear";
  require_tensor_of(op, "x", x, Device::kCPU, 2, DType::kFloat32);
  require_device(op, "out", out, Device::kCPU);
  require_dtype(op, "out", out, DType::kFloat32);
  require_ndim(op, "out", out, 2);
  const int64_t rows = x.size(0);
  const int64_t k_size = x.size(1);
  const BlockFormat& format = gguf::check_block_matrix(op, blocks, type, k_size);
  const int64_t n_size = blocks.size(0);
  require_size(op, "out", out, 0, rows);
  require_size(op, "out", out, 1, n_size);
  PS_REQUIRE(out.stride(1) == 1 && out.stride(0) >= n_size, op,
             "out must have contiguous rows, got " + out.describe());
  if (bias) {
    require_tensor_of(op, "bias", *bias, Device::kCPU, 1, DType::kFloat32);
    require_size(op, "bias", *bias, 0, n_size);
  }
  const gguf::LinearArgs args{x.ptr<float>(), blocks.ptr<uint8_t>(), bias ? bias->ptr<float>() : nullptr,
                              out.ptr<float>(), rows, k_size, n_size, out.stride(0), blocks.size(1)};
  if (gguf::is_interleaved_type(type)) return run_interleaved(args, format);
  if (gguf::int8_activations_apply(format.type)) {  // AVX2 and above: int8 activations (gguf_int8.h)
    return gguf::linear_int8_activations(format.type, args);
  }
  run_float32(args, format);
}

}  // namespace pagedserve::ops
