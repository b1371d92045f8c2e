// sample_tokens: Gumbel-max sampling: each row's argmax, then a pass that scores only the tokens that could win.
#include <array>
#include <cmath>
#include <limits>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "ops/cpu_isa.h"
#include "ops/dispatch.h"
#include "ops/float_types.h"
#include "ops/gumbel_noise.h"
#include "ops/op_contracts.h"
#include "ops/ops.h"
#include "ops/parallel.h"
#include "ops/token_mask.h"

namespace pagedserve::ops {
namespace {

// Token v's logit, or -inf where `allowed` (one row of the bitmask, or null) clears its bit.
template <typename T>
float masked_logit(const T* logits, const int32_t* allowed, int64_t v) {
  return token_allowed(allowed, v) ? to_float(logits[v]) : -std::numeric_limits<float>::infinity();
}

// noise_bucket_bound for every bucket, computed once.
const float* noise_bounds() {
  static const std::array<float, kNoiseBuckets> table = [] {
    std::array<float, kNoiseBuckets> bounds{};
    for (int b = 0; b < kNoiseBuckets; ++b) bounds[b] = noise_bucket_bound(b);
    return bounds;
  }();
  return table.data();
}

// The running best (score, id) of a sampled row.
struct Best {
  float score;
  int64_t id;

  void consider(float score_v, int64_t v) {
    if (score_v > score || (score_v == score && v < id)) {
      score = score_v;
      id = v;
    }
  }
};

// Tokens [begin, end) of a sampled row, each scored unless it cannot beat the best so far, as the CUDA kernel
// skips them (sampling_kernel.cu): when its logit / T plus the largest noise any bits give, or plus its own
// bucket's largest noise, stays below the best. fmaf is monotone in the added noise, so a skipped token scores
// below a computed one, and ties (lowest id wins) never skip. One fused multiply-add a score, as the CUDA
// kernel does, so both round alike.
template <typename T>
PS_ALWAYS_INLINE void score_tokens(Best& best, const T* logits, const int32_t* allowed, int64_t begin, int64_t end,
                                   float inv_t, uint64_t key, const float* bound) {
  for (int64_t v = begin; v < end; ++v) {
    const float x = masked_logit(logits, allowed, v);
    if (std::fma(x, inv_t, kMaxGumbel) < best.score) continue;
    const uint32_t bits = noise_bits(key, v);
    if (std::fma(x, inv_t, bound[noise_bucket(bits)]) < best.score) continue;
    best.consider(std::fma(x, inv_t, gumbel_noise(bits)), v);
  }
}

#if PS_X86_MULTIVERSION
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's AVX-512 headers (see packed_linear_x86.inc)
#pragma GCC diagnostic ignored "-Wuninitialized"

// Logits [v, v + 16) as float32 (exact widening), -inf where the row's bitmask clears a token (v % 16 == 0).
template <typename T>
[[gnu::target("arch=x86-64-v4")]] PS_ALWAYS_INLINE __m512 load16(const T* logits, const int32_t* allowed, int64_t v) {
  __m512 x;
  if constexpr (std::is_same_v<T, float>) {
    x = _mm512_loadu_ps(logits + v);
  } else {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(logits + v));
    if constexpr (std::is_same_v<T, BFloat16>) {
      x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    } else {
      x = _mm512_cvtph_ps(raw);
    }
  }
  if (allowed == nullptr) return x;
  const auto bits = static_cast<__mmask16>(static_cast<uint32_t>(allowed[v / 32]) >> (v % 32));
  return _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), bits, x);
}

// mix64 of 8 lanes.
[[gnu::target("arch=x86-64-v4")]] PS_ALWAYS_INLINE __m512i mix64x8(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi64(x, 30));
  x = _mm512_mullo_epi64(x, _mm512_set1_epi64(static_cast<int64_t>(0xbf58476d1ce4e5b9ULL)));
  x = _mm512_xor_si512(x, _mm512_srli_epi64(x, 27));
  x = _mm512_mullo_epi64(x, _mm512_set1_epi64(static_cast<int64_t>(0x94d049bb133111ebULL)));
  return _mm512_xor_si512(x, _mm512_srli_epi64(x, 31));
}

// score_tokens 16 tokens a step: the two skip tests for all 16 in vector registers (the hash only where the
// first lets some through), the scores of the few left one by one in id order. 64 rows of 49,152 random
// logits on 2 Intel cores: 4.1-4.9 ms, against 15-19 ms one token at a time.
template <typename T>
[[gnu::target("arch=x86-64-v4")]] void score_tokens_avx512(Best& best, const T* logits, const int32_t* allowed,
                                                         int64_t vocab, float inv_t, uint64_t key, const float* bound) {
  constexpr uint64_t kStep = 0x9e3779b97f4a7c15ULL;  // noise_bits' multiplier
  const __m512i lane_steps_lo = _mm512_set_epi64(7 * kStep, 6 * kStep, 5 * kStep, 4 * kStep, 3 * kStep, 2 * kStep,
                                                 kStep, 0);
  const __m512i lane_steps_hi = _mm512_add_epi64(lane_steps_lo, _mm512_set1_epi64(static_cast<int64_t>(8 * kStep)));
  const __m512 t = _mm512_set1_ps(inv_t), max_noise = _mm512_set1_ps(kMaxGumbel);
  const __m512i coarse_buckets = _mm512_set1_epi32(kCoarseNoiseBuckets), byte = _mm512_set1_epi32(255);
  const int64_t vector_end = vocab / 16 * 16;
  alignas(64) float x_lanes[16];
  alignas(64) uint32_t bit_lanes[16];
  for (int64_t v = 0; v < vector_end; v += 16) {
    const __m512 x = load16(logits, allowed, v);
    const __m512 best_score = _mm512_set1_ps(best.score);
    __mmask16 pass = _mm512_cmp_ps_mask(_mm512_fmadd_ps(x, t, max_noise), best_score, _CMP_NLT_UQ);
    if (pass == 0) continue;
    const __m512i base = _mm512_set1_epi64(static_cast<int64_t>(key + static_cast<uint64_t>(v) * kStep));
    const __m256i lo = _mm512_cvtepi64_epi32(_mm512_srli_epi64(mix64x8(_mm512_add_epi64(base, lane_steps_lo)), 32));
    const __m256i hi = _mm512_cvtepi64_epi32(_mm512_srli_epi64(mix64x8(_mm512_add_epi64(base, lane_steps_hi)), 32));
    const __m512i bits = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    const __m512i coarse = _mm512_srli_epi32(bits, 24);
    const __m512i fine = _mm512_add_epi32(coarse_buckets, _mm512_and_si512(_mm512_srli_epi32(bits, 16), byte));
    const __m512i bucket = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(coarse, coarse_buckets), fine, coarse);
    const __m512 bounded = _mm512_fmadd_ps(x, t, _mm512_i32gather_ps(bucket, bound, 4));
    pass &= _mm512_cmp_ps_mask(bounded, best_score, _CMP_NLT_UQ);
    if (pass == 0) continue;
    _mm512_store_ps(x_lanes, x);
    _mm512_store_si512(bit_lanes, bits);
    for (; pass != 0; pass &= pass - 1) {
      const int lane = __builtin_ctz(pass);
      best.consider(std::fma(x_lanes[lane], inv_t, gumbel_noise(bit_lanes[lane])), v + lane);
    }
  }
  score_tokens(best, logits, allowed, vector_end, vocab, inv_t, key, bound);
}

#pragma GCC diagnostic pop
#endif

// The argmax first (the answer for greedy rows, a head start otherwise), then score_tokens over the row. The
// two logarithms remain for ~1 token in 1,000: 64 rows of 49,152 random logits took 57 ms on 2 cores (Intel
// VM) when every token within kMaxGumbel of the argmax took them.
template <typename T>
int32_t sample_row(const T* logits, const int32_t* allowed, int64_t vocab, float inv_temperature, uint64_t key) {
  float top = -std::numeric_limits<float>::infinity();
  int64_t top_id = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    const float x = masked_logit(logits, allowed, v);
    if (x > top) {
      top = x;
      top_id = v;
    }
  }
  if (inv_temperature <= 0.0f) return static_cast<int32_t>(top_id);
  Best best{std::fma(top, inv_temperature, gumbel_noise(noise_bits(key, top_id))), top_id};
  const float* bound = noise_bounds();
#if PS_X86_MULTIVERSION
  if (cpu_isa() >= CpuIsa::kAvx512) {
    score_tokens_avx512(best, logits, allowed, vocab, inv_temperature, key, bound);
    return static_cast<int32_t>(best.id);
  }
#endif
  score_tokens(best, logits, allowed, 0, vocab, inv_temperature, key, bound);
  return static_cast<int32_t>(best.id);
}

}  // namespace

void sample_tokens(const TensorView& out, const TensorView& logits, const TensorView& inv_temperature,
                   const TensorView& allowed, uint64_t seed) {
  constexpr std::string_view op = "sample_tokens";
  check_sample_tokens(Device::kCPU, out, logits, inv_temperature, allowed);
  const int64_t rows = logits.size(0), vocab = logits.size(1), words = token_mask_words(vocab);
  const float* inv_t = inv_temperature.ptr<const float>();
  const int32_t* mask = allowed.data == nullptr ? nullptr : allowed.ptr<const int32_t>();
  int32_t* ids = out.ptr<int32_t>();
  dispatch_float(logits.dtype, op, [&]<typename T>() {
    const T* base = logits.ptr<const T>();
    parallel_run(rows * vocab).for_each(rows, [&](int64_t r, int) {
      ids[r] = sample_row(base + r * vocab, mask == nullptr ? nullptr : mask + r * words, vocab, inv_t[r],
                          gumbel_row_key(seed, r));
    });
  });
}

}  // namespace pagedserve::ops
