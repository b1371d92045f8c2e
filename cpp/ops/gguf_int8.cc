// gguf_int8.h's kernels: x quantized per 32-element block, then vpdpbusd
// dot products against the GGUF blocks' codes.
//
// vpdpbusd multiplies unsigned bytes by signed bytes, so each format puts
// its operands where the signs fit and corrects the offset exactly in int32:
//   Q4_0  codes q in 0..15 (unsigned) x activations (signed); the format's
//         -8 is added back as -8 sum(x_q), from one vpdpbusd of 8s by x_q
//         per block of x, shared by the 4 weight rows of a tile.
//   Q4_1  codes unsigned as above; the min term m sum(x_q) is a float one,
//         from the same per-lane sums of x_q (a vpdpbusd of 1s).
//   Q4_K, Q5_K  as Q4_1, per 32-weight sub-block (each aligned with one block of x): codes
//         0..15 / 0..31, scale d sc_j and min -dmin m_j, decoded once per super-block and row.
//   Q6_K  codes 0..63 unsigned; the format's -32 as Q4_0's -8; the two 16-weight scales of a
//         32-weight block sit in lanes 0-3 and 4-7 (each lane sums 4 consecutive weights).
//   Q8_0  both signed: the codes become w + 128 (unsigned), less 128 sum(x_q)
//         per lane, as Q4_0's -8 (shared by the 4 weight rows; computed from
//         the weights instead it cost one more vpdpbusd per weight block and
//         row at M = 1, and the Q8_0 LM head ran at 10 GB/s against Q4_1's 14).
// Each block's int32 lanes are converted to float and scaled by
// d_w d_x (one rounding for the product, then a fused multiply-add into
// the row's 8-lane accumulator); the lanes are added at the end in a fixed
// order.
//
// 256-bit registers: one 32-weight block per register, which AVX-512's
// 512-bit units on Zen 4 run at the same rate (they are two 256-bit halves).
#include "ops/gguf_int8.h"

#include <algorithm>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "ops/cpu_isa.h"
#include "ops/parallel.h"

namespace pagedserve::ops::gguf {

#if PS_X86_MULTIVERSION
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's AVX-512 headers (see packed_linear.cc)
namespace {

constexpr int kBlock = 32;         // elements per block of x and of every format here
// Weight rows per register block: 4 share each block of x they multiply, except when x has a single row
// (a decode step of one sequence). Then one: the tile walks the weight as one stream, where 4 rows side
// by side are 4 interleaved streams the hardware prefetcher follows poorly (Zen 4, weights streamed from
// DRAM, M = 1: the Q8_0 LM head 49152 x 576 at 22-25 GB/s with 4 rows, 29-35 with one; Q4_1 products
// 10-20 % faster). A (row, output) pair's arithmetic is the same at either size.
constexpr int kTileRows = 4;
constexpr int kSingleRowTile = 1;
constexpr int kXRows = 4;          // rows of x per register block
constexpr int64_t kRowChunk = 64;  // rows of x per pass over a thread's tiles (64 x 1536 B = 96 KiB in L2)

#define PS_VNNI [[gnu::target("arch=x86-64-v4,avx512vnni")]]
#define PS_VNNI_INLINE PS_VNNI PS_ALWAYS_INLINE

bool cpu_has_avx512_vnni() {
  static const bool has = __builtin_cpu_supports("avx512vnni");  // CPUID leaf 7, ECX bit 11
  return has;
}

// x quantized: row m's block b is q[m K + 32 b ..] (int8 in [-127, 127]) times d[m K / 32 + b].
// lanes[8 (m K / 32 + b) ..]: the block's 8 per-lane terms the format needs (XBlock's sums or
// offset), made once per call instead of once per weight row that meets the block (a vpdpbusd and a
// conversion per weight block at M = 1; the default model's Q4_1 decode on Zen 4, interleaved runs:
// 5.2-6.6 vs 6.2-6.5 ms a token, min of 5; the same bits).
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<uint32_t> lanes;
};

// d = max |x| / 127; q = x (1 / d) rounded to nearest, ties to even (MXCSR's default mode);
// q = 0 where the block is zero. tests_py/test_ops_gguf.py repeats these steps in numpy.
PS_VNNI void quantize_row(const float* x, int64_t k_size, int8_t* q, float* d) {
  for (int64_t b = 0; b < k_size / kBlock; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + kBlock * b);
    const __m512 x1 = _mm512_loadu_ps(x + kBlock * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float scale = amax / 127.0f;
    const __m512 inverse = _mm512_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
    d[b] = scale;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + kBlock * b),
                     _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x0, inverse))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + kBlock * b + 16),
                     _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x1, inverse))));
  }
}

QuantizedX quantize_x(const LinearArgs& a) {
  const int64_t blocks = a.in_features / kBlock;
  QuantizedX qx{std::vector<int8_t>(static_cast<size_t>(a.rows * a.in_features)),
                std::vector<float>(static_cast<size_t>(a.rows * blocks)), {}};
  parallel_for_range(a.rows, 2 * a.in_features, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      quantize_row(a.x + m * a.in_features, a.in_features, qx.q.data() + m * a.in_features,
                   qx.d.data() + m * blocks);
    }
  });
  return qx;
}

PS_VNNI_INLINE float half_value(const uint8_t* p) {
  uint16_t bits;
  __builtin_memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

PS_VNNI_INLINE __m256i nibbles(const uint8_t* p) {  // 16 bytes -> 32 codes: low halves, then high halves
  // Both halves hold the 16 bytes (one broadcast load); the upper one is shifted right by 4.
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi64(both, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0f));
}

// One weight block in registers.
struct WeightBlock {
  __m256i codes;  // unsigned (Q8_0: w + 128)
  __m256 scale;   // per lane: Q6_K's lanes 0-3 and 4-7 hold its two 16-weight scales
  __m256 min;     // Q4_1, Q4_K, Q5_K
};

constexpr bool is_k_quant(BlockType t) {
  return t == BlockType::kQ4_K || t == BlockType::kQ5_K || t == BlockType::kQ6_K;
}

// The 32-weight blocks per block of the format: a K-quant super-block holds 8 sub-blocks, each
// aligned with one block of x.
template <BlockType kType>
constexpr int kSubBlocks = is_k_quant(kType) ? 8 : 1;

// One block of the format (a K-quant super-block) of one weight row, its scales decoded once for
// the 8 sub-blocks: scale[j] = d sc_j and min[j] = -dmin m_j (Q4_K, Q5_K; both exact in float32:
// an 11-bit float16 mantissa times a 6-bit integer), or scale[i] = d scales[i] (Q6_K, 16 of them).
struct SuperBlock {
  const uint8_t* p;
  float scale[16];
  float min[8];
};

PS_VNNI_INLINE __m256 widen(uint64_t bytes) {  // 8 unsigned bytes -> 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(bytes))));
}

template <BlockType kType>
PS_VNNI_INLINE SuperBlock load_super(const uint8_t* row, int64_t s) {
  SuperBlock sb;
  if constexpr (kType == BlockType::kQ4_K || kType == BlockType::kQ5_K) {
    sb.p = row + (kType == BlockType::kQ4_K ? 144 : 176) * s;
    // k_scale_min() for all 8 sub-blocks at once, 4 bytes to a word: words u0, u1, u2 of the 12
    // bytes give scales 0-3 = u0 & 63, mins 0-3 = u1 & 63, and for 4-7 the nibbles of u2 (low:
    // scales, high: mins) under u0's and u1's top 2 bits.
    uint32_t u[3];
    __builtin_memcpy(u, sb.p + 4, 12);
    constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
    const uint64_t scales = (u[0] & kLow6) | uint64_t((u[2] & kLow4) | (((u[0] >> 6) & kLow2) << 4)) << 32;
    const uint64_t mins = (u[1] & kLow6) | uint64_t(((u[2] >> 4) & kLow4) | (((u[1] >> 6) & kLow2) << 4)) << 32;
    _mm256_storeu_ps(sb.scale, _mm256_mul_ps(_mm256_set1_ps(half_value(sb.p)), widen(scales)));
    _mm256_storeu_ps(sb.min, _mm256_mul_ps(_mm256_set1_ps(-half_value(sb.p + 2)), widen(mins)));
  } else if constexpr (kType == BlockType::kQ6_K) {
    sb.p = row + 210 * s;
    const __m512 d = _mm512_set1_ps(half_value(sb.p + 208));
    const __m512i scales = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb.p + 192)));
    _mm512_storeu_ps(sb.scale, _mm512_mul_ps(d, _mm512_cvtepi32_ps(scales)));
  } else {
    sb.p = row + (kType == BlockType::kQ4_0 ? 18 : kType == BlockType::kQ4_1 ? 20 : 34) * s;
  }
  return sb;
}

PS_VNNI_INLINE __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Bytes of `v` shifted right by `shift` bits (0..7), masked to `mask`: one 16-bit shift, whose bits
// carried in from the neighbouring byte fall outside the mask.
PS_VNNI_INLINE __m256i byte_bits(__m256i v, int shift, int mask) {
  return _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi8(static_cast<char>(mask)));
}

// Block j of the format's block `sb` (sub-block j of a K-quant super-block; j = 0 otherwise).
template <BlockType kType>
PS_VNNI_INLINE WeightBlock load_weight(const SuperBlock& sb, int j) {
  WeightBlock w{};
  const uint8_t* p = sb.p;
  if constexpr (kType == BlockType::kQ4_0) {
    w.scale = _mm256_set1_ps(half_value(p));
    w.codes = nibbles(p + 2);
  } else if constexpr (kType == BlockType::kQ4_1) {
    int32_t pair;  // d and m, adjacent: one conversion for both
    __builtin_memcpy(&pair, p, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(pair));
    w.scale = _mm256_broadcastss_ps(dm);
    w.min = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
    w.codes = nibbles(p + 4);
  } else if constexpr (kType == BlockType::kQ8_0) {
    w.scale = _mm256_set1_ps(half_value(p));
    w.codes = _mm256_xor_si256(load32(p + 2), _mm256_set1_epi8(static_cast<char>(0x80)));  // w + 128
  } else if constexpr (kType == BlockType::kQ4_K || kType == BlockType::kQ5_K) {
    // Sub-blocks 2g and 2g + 1 share the 32 nibble bytes [32 g, 32 g + 32): low, then high halves.
    const uint8_t* q = p + (kType == BlockType::kQ4_K ? 16 : 48) + 32 * (j / 2);
    w.codes = byte_bits(load32(q), 4 * (j % 2), 0x0f);
    if constexpr (kType == BlockType::kQ5_K) {  // bit j of qh[i] is bit 4 of element i
      const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
      const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(load32(p + 16), bit), bit);
      w.codes = _mm256_or_si256(w.codes, _mm256_and_si256(set, _mm256_set1_epi8(16)));
    }
    w.scale = _mm256_set1_ps(sb.scale[j]);
    w.min = _mm256_set1_ps(sb.min[j]);
  } else {  // Q6_K: elements 32 j .. 32 j + 32, j = 4 h + part (gguf_blocks.h)
    const int h = j / 4, part = j % 4;
    const __m256i low = byte_bits(load32(p + 64 * h + 32 * (part % 2)), 4 * (part / 2), 0x0f);
    const __m256i high = byte_bits(load32(p + 128 + 32 * h), 2 * part, 0x03);
    w.codes = _mm256_or_si256(low, _mm256_slli_epi16(high, 4));  // 0..63; the format's -32 is x's offset
    w.scale = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(sb.scale[2 * j])),
                                   _mm_set1_ps(sb.scale[2 * j + 1]), 1);
  }
  return w;
}

// One block of a row of x in registers, prepared for the format.
struct XBlock {
  __m256i q;       // x_q
  __m256 scale;    // d_x
  __m256i offset;  // Q4_0: -8 sum(x_q) per lane; Q6_K: -32 sum(x_q); Q8_0: -128 sum(x_q)
  __m256 sums;     // Q4_1, Q4_K, Q5_K: sum(x_q) per lane, as float
};

constexpr bool has_min(BlockType t) { return t == BlockType::kQ4_1 || t == BlockType::kQ4_K || t == BlockType::kQ5_K; }

// XBlock's per-lane term of the block q: sums (as float bits) or offset.
template <BlockType kType>
PS_VNNI_INLINE __m256i lane_terms(const int8_t* q) {
  const __m256i zero = _mm256_setzero_si256();
  const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  if constexpr (has_min(kType)) {
    return _mm256_castps_si256(_mm256_cvtepi32_ps(_mm256_dpbusd_epi32(zero, _mm256_set1_epi8(1), codes)));
  } else {  // the codes' offset (unsigned bytes: 128 as 0x80)
    const int code_offset = kType == BlockType::kQ4_0 ? 8 : kType == BlockType::kQ6_K ? 32 : 128;
    return _mm256_sub_epi32(zero, _mm256_dpbusd_epi32(zero, _mm256_set1_epi8(static_cast<char>(code_offset)), codes));
  }
}

template <BlockType kType>
PS_VNNI void fill_lane_terms(QuantizedX& qx, int64_t begin, int64_t end) {
  for (int64_t b = begin; b < end; ++b) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx.lanes.data() + 8 * b),
                        lane_terms<kType>(qx.q.data() + kBlock * b));
  }
}

template <BlockType kType>
void fill_lane_terms(QuantizedX& qx) {
  const auto blocks = static_cast<int64_t>(qx.d.size());
  qx.lanes.resize(static_cast<size_t>(8 * blocks));
  parallel_for_range(blocks, 2 * kBlock, [&](int64_t begin, int64_t end) { fill_lane_terms<kType>(qx, begin, end); });
}

// Block `b` (of all rows' blocks) of x.
template <BlockType kType>
PS_VNNI_INLINE XBlock load_x(const QuantizedX& qx, int64_t b) {
  XBlock x{};
  x.q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx.q.data() + kBlock * b));
  x.scale = _mm256_set1_ps(qx.d[static_cast<size_t>(b)]);
  const __m256i terms = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx.lanes.data() + 8 * b));
  if constexpr (has_min(kType)) {
    x.sums = _mm256_castsi256_ps(terms);
  } else {
    x.offset = terms;
  }
  return x;
}

// acc += this block's contribution to one output, 8 lanes.
template <BlockType kType>
PS_VNNI_INLINE __m256 accumulate(const WeightBlock& w, const XBlock& x, __m256 acc) {
  if constexpr (has_min(kType)) {
    const __m256 dot = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w.codes, x.q));
    const __m256 block = _mm256_fmadd_ps(dot, w.scale, _mm256_mul_ps(w.min, x.sums));
    return _mm256_fmadd_ps(block, x.scale, acc);
  } else {  // Q4_0, Q6_K, Q8_0: the offset starts the integer sum
    const __m256 dot = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(x.offset, w.codes, x.q));
    return _mm256_fmadd_ps(dot, _mm256_mul_ps(w.scale, x.scale), acc);
  }
}

PS_VNNI_INLINE float sum_lanes(__m256 v) {  // ((0+4) + (2+6)) + ((1+5) + (3+7))
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

template <int kRowsPerTile>
struct Tile {
  const uint8_t* rows[kRowsPerTile];
  int64_t first;  // output feature of rows[0]
  int64_t valid;  // rows that are real (the rest repeat the last one and are not stored)
};

// Rows [m0, m0 + kM) of x against one tile of weight rows. Every (row, output) pair runs the
// same instructions whatever kM is, so a row's result does not depend on its neighbours.
template <BlockType kType, int kM, int kRowsPerTile>
PS_VNNI void dot_tile(const LinearArgs& a, const QuantizedX& qx, const Tile<kRowsPerTile>& t, int64_t m0) {
  const int64_t blocks = a.in_features / kBlock;
  __m256 acc[kM][kRowsPerTile];
  for (int m = 0; m < kM; ++m) {
    for (int r = 0; r < kRowsPerTile; ++r) acc[m][r] = _mm256_setzero_ps();
  }
  constexpr int kSub = kSubBlocks<kType>;
  const int64_t format_blocks = blocks / kSub;
  const int64_t block_bytes = a.row_bytes / format_blocks;  // the prefetch address: no division per block
  for (int64_t s = 0; s < format_blocks; ++s) {
    SuperBlock sb[kRowsPerTile];
#pragma GCC unroll 4
    for (int r = 0; r < kRowsPerTile; ++r) sb[r] = load_super<kType>(t.rows[r], s);
    // The next tile's block s (its rows follow this tile's), per row: a K-quant's 144 to 210 bytes are 4
    // lines from its start; the 18- to 34-byte blocks, one line every other block. Without it a Q5_K LM head
    // streaming from DRAM ran at ~3.4 GB/s instead of ~6 (49152 x 768, one thread, busy Zen 4), and the
    // Q8_0 one at ~10 GB/s instead of ~23 (49152 x 576, two threads). The last tile reads one tile past
    // the weight only as a prefetch, which never faults.
    constexpr int kLines = is_k_quant(kType) ? 4 : 1;
    if (is_k_quant(kType) || s % 2 == 0) {
      const uint8_t* next = t.rows[0] + kRowsPerTile * a.row_bytes + block_bytes * s;
      for (int r = 0; r < kRowsPerTile; ++r) {
        const char* block = reinterpret_cast<const char*>(next + r * a.row_bytes);
        for (int line = 0; line < kLines; ++line) _mm_prefetch(block + 64 * line, _MM_HINT_T0);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < kSub; ++j) {
      const int64_t b = kSub * s + j;
      WeightBlock w[kRowsPerTile];
#pragma GCC unroll 4
      for (int r = 0; r < kRowsPerTile; ++r) w[r] = load_weight<kType>(sb[r], j);
#pragma GCC unroll 4
      for (int m = 0; m < kM; ++m) {
        const XBlock x = load_x<kType>(qx, (m0 + m) * blocks + b);
#pragma GCC unroll 4
        for (int r = 0; r < kRowsPerTile; ++r) acc[m][r] = accumulate<kType>(w[r], x, acc[m][r]);
      }
    }
  }
  for (int m = 0; m < kM; ++m) {
    for (int64_t r = 0; r < t.valid; ++r) {
      const int64_t n = t.first + r;
      a.out[(m0 + m) * a.out_stride + n] = sum_lanes(acc[m][r]) + (a.bias ? a.bias[n] : 0.0f);
    }
  }
}

template <BlockType kType, int kRowsPerTile, int kM = kXRows>
PS_VNNI void dot_rows(int rows, const LinearArgs& a, const QuantizedX& qx, const Tile<kRowsPerTile>& t, int64_t m0) {
  if constexpr (kM >= 1) {
    if (rows == kM) return dot_tile<kType, kM>(a, qx, t, m0);
    return dot_rows<kType, kRowsPerTile, kM - 1>(rows, a, qx, t, m0);
  }
}

template <BlockType kType, int kRowsPerTile>
void run_tiles(const LinearArgs& a, const QuantizedX& qx) {
  const int64_t tiles = (a.out_features + kRowsPerTile - 1) / kRowsPerTile;
  // Work units (parallel.h): about one per weight byte-pair decoded and per 4-byte vpdpbusd lane.
  const int64_t work_per_tile = kRowsPerTile * a.in_features * (1 + a.rows / 4);
  parallel_for_range(tiles, work_per_tile, [&](int64_t tile_begin, int64_t tile_end) {
    for (int64_t row_begin = 0; row_begin < a.rows; row_begin += kRowChunk) {
      const int64_t row_end = std::min(a.rows, row_begin + kRowChunk);
      for (int64_t t = tile_begin; t < tile_end; ++t) {
        const int64_t first = t * kRowsPerTile;
        Tile<kRowsPerTile> tile{{}, first, std::min<int64_t>(kRowsPerTile, a.out_features - first)};
        for (int r = 0; r < kRowsPerTile; ++r) {
          tile.rows[r] = a.blocks + (tile.first + std::min<int64_t>(r, tile.valid - 1)) * a.row_bytes;
        }
        for (int64_t m0 = row_begin; m0 < row_end; m0 += kXRows) {
          dot_rows<kType>(static_cast<int>(std::min<int64_t>(kXRows, row_end - m0)), a, qx, tile, m0);
        }
      }
    }
  });
}

template <BlockType kType>
void run(const LinearArgs& a) {
  QuantizedX qx = quantize_x(a);
  fill_lane_terms<kType>(qx);
  if (a.rows == 1) return run_tiles<kType, kSingleRowTile>(a, qx);
  run_tiles<kType, kTileRows>(a, qx);
}

}  // namespace
#pragma GCC diagnostic pop

bool int8_activations_apply(BlockType) {  // every format of gguf_blocks.h has a kernel here
  return cpu_isa() >= CpuIsa::kAvx512 && cpu_has_avx512_vnni();
}

void linear_int8_activations(BlockType type, const LinearArgs& args) {
  switch (type) {
    case BlockType::kQ4_0: return run<BlockType::kQ4_0>(args);
    case BlockType::kQ4_1: return run<BlockType::kQ4_1>(args);
    case BlockType::kQ8_0: return run<BlockType::kQ8_0>(args);
    case BlockType::kQ4_K: return run<BlockType::kQ4_K>(args);
    case BlockType::kQ5_K: return run<BlockType::kQ5_K>(args);
    case BlockType::kQ6_K: return run<BlockType::kQ6_K>(args);
  }
}

#else  // no x86-64 multiversioning: the float32 kernels only

bool int8_activations_apply(BlockType) { return false; }
void linear_int8_activations(BlockType, const LinearArgs&) {}

#endif

}  // namespace pagedserve::ops::gguf
