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
// Two instruction sets, one arithmetic (gguf_int8_kernels.inc holds the
// kernels, and gguf_int8_interleaved.inc those over interleaved blocks
// (gguf_interleaved.h), each included once per set):
//   avx512_vnni  vpdpbusd: 4 u8 x s8 products into each int32 lane;
//   avx2         vpmaddubsw then vpmaddwd by ones, the same 4 products into
//                the same lane (Zen 3, Haswell and later; AVX-512 CPUs without
//                VNNI). vpmaddubsw adds pairs in int16 with saturation, so
//                every unsigned operand is kept at most 128 (2 x 128 x 127 =
//                32512): Q8_0's codes stay signed and multiply as
//                |w| x sign(w) x_q (vpsignb), with no offset to correct.
// The int32 lanes come out equal, so both give the same bits.
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
#include "ops/gguf_interleaved.h"
#include "ops/parallel.h"

namespace pagedserve::ops::gguf {

#if PS_X86_MULTIVERSION
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's AVX-512 headers (see packed_linear_x86.inc)
namespace {

constexpr int kBlock = 32;  // elements per block of x and of every format here

bool has_avx512_vnni() {
  static const bool has = __builtin_cpu_supports("avx512vnni");  // CPUID leaf 7, ECX bit 11
  return has;
}

// How a batch-1 product streams interleaved weights (gguf_int8_interleaved.inc), where the weights come
// from memory and their stream is the whole cost: how far ahead of its block each weight stream asks for
// lines (it runs out of line-fill buffers before the hardware prefetcher runs far enough ahead), and
// whether the 512-bit body takes two groups a pass (two streams, half the instructions a byte; the same
// bits either way). Measured per vendor, 2 threads, the default model's linears at one row:
//   AMD (Zen 3, bench/results/intel_amx/session26.md): 1 KiB ahead 12.4-12.7 GB/s, 2 KiB 11.9-12.4,
//       4 KiB 10.7-11.7; one group a pass (Zen 3 has no 512-bit body; Zen 4/5 not measured wide).
//   Intel (Emerald Rapids 2-core VM, session 41): decode at batch 1 from the Q4_1 file, 10 interleaved
//       rounds, ms a token: 1 KiB narrow 7.85, 4 KiB narrow 6.80, 4 KiB wide 6.38 (8 KiB 6.37, 2 KiB 7.20).
struct StreamTuning {
  int prefetch_bytes;
  bool wide_single_row;
};

StreamTuning this_cpus_stream_tuning() {
  __builtin_cpu_init();  // static initialization may run before libgcc's own
  return __builtin_cpu_is("intel") ? StreamTuning{4096, true} : StreamTuning{1024, false};
}

// Read on every block at M = 1: a plain constant, decided once at load.
const StreamTuning kStreamTuning = this_cpus_stream_tuning();

}  // namespace

namespace vnni {
namespace {
#define PS_GGUF_KERNEL [[gnu::target("arch=x86-64-v4,avx512vnni")]]
#define PS_GGUF_INLINE PS_GGUF_KERNEL PS_ALWAYS_INLINE

constexpr int kQ8CodeOffset = 128;  // Q8_0's codes are w + 128, unsigned

PS_GGUF_INLINE __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
PS_GGUF_INLINE __m256i q8_codes(__m256i w) { return _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80))); }
PS_GGUF_INLINE __m256i dot_q8(__m256i acc, __m256i codes, __m256i s) { return dot_u8s8(acc, codes, s); }

// d = max |x| / 127; q = x (1 / d) rounded to nearest, ties to even (MXCSR's default mode);
// q = 0 where the block is zero. tests_py/test_ops_gguf.py repeats these steps in numpy.
PS_GGUF_KERNEL void quantize_row(const float* x, int64_t k_size, int8_t* q, float* d) {
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

// int32 lanes straight away (gguf_int8_interleaved.inc).
PS_GGUF_INLINE __m256i q4_add(__m256i acc, __m256i codes, __m256i x) { return dot_u8s8(acc, codes, x); }
PS_GGUF_INLINE __m256i q4_total(__m256i acc) { return acc; }

#include "ops/gguf_int8_kernels.inc"
#define PS_GGUF_WIDE 1
#include "ops/gguf_int8_interleaved.inc"
#undef PS_GGUF_WIDE

#undef PS_GGUF_INLINE
#undef PS_GGUF_KERNEL
}  // namespace
}  // namespace vnni

namespace avx2 {
namespace {
#define PS_GGUF_KERNEL [[gnu::target("arch=x86-64-v3")]]
#define PS_GGUF_INLINE PS_GGUF_KERNEL PS_ALWAYS_INLINE

constexpr int kQ8CodeOffset = 0;  // Q8_0's codes stay signed (dot_q8)

// u <= 128 and |s| <= 127: each int16 pair sum fits (no saturation), so the lanes equal vpdpbusd's.
PS_GGUF_INLINE __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
PS_GGUF_INLINE __m256i q8_codes(__m256i w) { return w; }
// sum w x_q as |w| (unsigned, at most 128) times x_q with w's sign (0 where w = 0).
PS_GGUF_INLINE __m256i dot_q8(__m256i acc, __m256i w, __m256i s) {
  return dot_u8s8(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(s, w));
}

// vnni::quantize_row's steps on 8-lane registers: the same maximum (exact in any order), the same
// float32 scale, product and rounding; the int32 codes narrowed by two saturating packs (no value
// saturates: |q| <= 127), whose lane interleaving the final permutation undoes.
PS_GGUF_KERNEL void quantize_row(const float* x, int64_t k_size, int8_t* q, float* d) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < k_size / kBlock; ++b) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + kBlock * b + 8 * i);
    const __m256 m8 = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float scale = amax / 127.0f;
    const __m256 inverse = _mm256_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
    d[b] = scale;
    __m256i codes[4];
    for (int i = 0; i < 4; ++i) codes[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(codes[0], codes[1]),
                                              _mm256_packs_epi32(codes[2], codes[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + kBlock * b), _mm256_permutevar8x32_epi32(packed, order));
  }
}

// int16 pairs for half a block, widened once (gguf_int8_interleaved.inc: the bound).
PS_GGUF_INLINE __m256i q4_add(__m256i acc, __m256i codes, __m256i x) {
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(codes, x));
}
PS_GGUF_INLINE __m256i q4_total(__m256i acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }

#include "ops/gguf_int8_kernels.inc"
#define PS_GGUF_WIDE 0
#include "ops/gguf_int8_interleaved.inc"
#undef PS_GGUF_WIDE

#undef PS_GGUF_INLINE
#undef PS_GGUF_KERNEL
}  // namespace
}  // namespace avx2
#pragma GCC diagnostic pop

bool int8_activations_apply(BlockType) {  // every format of gguf_blocks.h has a kernel here
  return cpu_isa() >= CpuIsa::kAvx2;
}

namespace {

template <BlockType kType>
void run_on_this_cpu(const LinearArgs& args) {
  if (cpu_isa() >= CpuIsa::kAvx512 && has_avx512_vnni()) return vnni::run<kType>(args);
  avx2::run<kType>(args);
}

template <BlockType kType>
void run_interleaved_on_this_cpu(const LinearArgs& args) {
  if (cpu_isa() >= CpuIsa::kAvx512 && has_avx512_vnni()) return vnni::interleaved::run<kType>(args);
  avx2::interleaved::run<kType>(args);
}

}  // namespace

void linear_int8_interleaved(BlockType type, const LinearArgs& args) {
  switch (type) {
    case BlockType::kQ4_0: return run_interleaved_on_this_cpu<BlockType::kQ4_0>(args);
    case BlockType::kQ4_1: return run_interleaved_on_this_cpu<BlockType::kQ4_1>(args);
    case BlockType::kQ8_0: return run_interleaved_on_this_cpu<BlockType::kQ8_0>(args);
    case BlockType::kQ4_K: return run_interleaved_on_this_cpu<BlockType::kQ4_K>(args);
    case BlockType::kQ5_K: return run_interleaved_on_this_cpu<BlockType::kQ5_K>(args);
    case BlockType::kQ6_K: return run_interleaved_on_this_cpu<BlockType::kQ6_K>(args);
  }
}

void linear_int8_activations(BlockType type, const LinearArgs& args) {
  switch (type) {
    case BlockType::kQ4_0: return run_on_this_cpu<BlockType::kQ4_0>(args);
    case BlockType::kQ4_1: return run_on_this_cpu<BlockType::kQ4_1>(args);
    case BlockType::kQ8_0: return run_on_this_cpu<BlockType::kQ8_0>(args);
    case BlockType::kQ4_K: return run_on_this_cpu<BlockType::kQ4_K>(args);
    case BlockType::kQ5_K: return run_on_this_cpu<BlockType::kQ5_K>(args);
    case BlockType::kQ6_K: return run_on_this_cpu<BlockType::kQ6_K>(args);
  }
}

#else  // no x86-64 multiversioning: the float32 kernels only

bool int8_activations_apply(BlockType) { return false; }
void linear_int8_activations(BlockType, const LinearArgs&) {}
void linear_int8_interleaved(BlockType, const LinearArgs&) {}

#endif

}  // namespace pagedserve::ops::gguf
