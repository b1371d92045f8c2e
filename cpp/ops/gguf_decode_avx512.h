// AVX-512 decoders of the GGUF blocks (layouts: gguf_blocks.h), for the
// matrix product's hot loop: 16 weights per instruction sequence instead of
// the portable decoders' loops, which GCC does not vectorize well for the
// nibble formats (they ran at ~0.5 GB/s of blocks; these at the speed of the
// multiply-adds that follow). Each writes the block's weights as float32 to
// out by the portable decoders' formulas (product, then offset: no fused
// multiply-add), so both match the `gguf` package's dequantization.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <cstdint>

#include "ops/gguf_blocks.h"

namespace pagedserve::ops::gguf {

#define PS_AVX512 [[gnu::target("arch=x86-64-v4")]] PS_ALWAYS_INLINE

PS_AVX512 __m512i bytes_to_i32(const uint8_t* p) {  // 16 unsigned bytes -> 16 int32
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

PS_AVX512 float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// out[0..16) = scale * code - min for 16 int32 codes, rounded as the portable decoders round
// (the product first, then the subtraction).
PS_AVX512 void store_affine(float* out, __m512i codes, __m512 scale, __m512 min) {
  _mm512_storeu_ps(out, _mm512_sub_ps(_mm512_mul_ps(scale, _mm512_cvtepi32_ps(codes)), min));
}

// The 32-weight formats decode into two registers (weights 0..15 and 16..31), which the M = 1
// product multiplies by x directly; decode_*_avx512 store them for the tiled path.
PS_AVX512 void load_q8_0_avx512(const uint8_t* b, __m512& w0, __m512& w1) {
  const __m512 d = _mm512_set1_ps(half_at(b));
  const auto* q = reinterpret_cast<const __m128i*>(b + 2);
  w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
  w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
}

PS_AVX512 void load_q4_0_avx512(const uint8_t* b, __m512& w0, __m512& w1) {
  const __m512 d = _mm512_set1_ps(half_at(b));
  const __m512i v = bytes_to_i32(b + 2);
  const __m512i eight = _mm512_set1_epi32(8);
  const __m512i low = _mm512_sub_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x0f)), eight);
  const __m512i high = _mm512_sub_epi32(_mm512_srli_epi32(v, 4), eight);
  w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(low));
  w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(high));
}

PS_AVX512 void load_q4_1_avx512(const uint8_t* b, __m512& w0, __m512& w1) {
  const __m512 d = _mm512_set1_ps(half_at(b));
  const __m512 m = _mm512_set1_ps(half_at(b + 2));
  const __m512i v = bytes_to_i32(b + 4);
  w0 = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0f)))), m);
  w1 = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4))), m);
}

// Block bytes and the register decoder of a 32-weight format.
template <BlockType kType>
PS_AVX512 void load_block32_avx512(const uint8_t* blocks, int64_t blk, __m512& w0, __m512& w1) {
  if constexpr (kType == BlockType::kQ8_0) load_q8_0_avx512(blocks + blk * 34, w0, w1);
  if constexpr (kType == BlockType::kQ4_0) load_q4_0_avx512(blocks + blk * 18, w0, w1);
  if constexpr (kType == BlockType::kQ4_1) load_q4_1_avx512(blocks + blk * 20, w0, w1);
}

template <BlockType kType>
inline constexpr bool kBlock32 =
    kType == BlockType::kQ8_0 || kType == BlockType::kQ4_0 || kType == BlockType::kQ4_1;

// Q4_K and Q5_K: sub-block j's 32 low-nibble codes (plus, for Q5_K, the high bit from qh).
template <bool kHighBit>
PS_AVX512 void decode_k4_avx512(const uint8_t* b, const uint8_t* qh, const uint8_t* q, float* out) {
  const float d = half_at(b);
  const float dmin = half_at(b + 2);
  const __m512i nibble = _mm512_set1_epi32(0x0f);
  __m512i high_bits[2] = {};
  if constexpr (kHighBit) high_bits[0] = bytes_to_i32(qh), high_bits[1] = bytes_to_i32(qh + 16);
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    k_scale_min(b + 4, j, sc, mn);
    const __m512 scale = _mm512_set1_ps(d * static_cast<float>(sc));
    const __m512 min = _mm512_set1_ps(dmin * static_cast<float>(mn));
    for (int half = 0; half < 2; ++half) {
      __m512i codes = bytes_to_i32(q + (j / 2) * 32 + 16 * half);
      codes = _mm512_and_si512(j % 2 ? _mm512_srli_epi32(codes, 4) : codes, nibble);
      if constexpr (kHighBit) {
        const __m512i bit = _mm512_and_si512(_mm512_srl_epi32(high_bits[half], _mm_cvtsi32_si128(j)),
                                             _mm512_set1_epi32(1));
        codes = _mm512_or_si512(codes, _mm512_slli_epi32(bit, 4));
      }
      store_affine(out + 32 * j + 16 * half, codes, scale, min);
    }
  }
}

PS_AVX512 void decode_q6_k_avx512(const uint8_t* b, float* out) {
  const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  const __m512i nibble = _mm512_set1_epi32(0x0f);
  const __m512i two_bits = _mm512_set1_epi32(3);
  const __m512i offset = _mm512_set1_epi32(32);
  for (int h = 0; h < 2; ++h) {
    for (int part = 0; part < 4; ++part) {
      const uint8_t* low = b + 64 * h + (part % 2) * 32;
      const uint8_t* high = b + 128 + 32 * h;
      const __m128i low_shift = _mm_cvtsi32_si128((part / 2) * 4);
      const __m128i high_shift = _mm_cvtsi32_si128(2 * part);
      for (int half = 0; half < 2; ++half) {
        const int base = 128 * h + 32 * part + 16 * half;
        const __m512i lo = _mm512_and_si512(_mm512_srl_epi32(bytes_to_i32(low + 16 * half), low_shift), nibble);
        const __m512i hi = _mm512_and_si512(_mm512_srl_epi32(bytes_to_i32(high + 16 * half), high_shift), two_bits);
        const __m512i codes = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), offset);
        const __m512 scale = _mm512_set1_ps(d * static_cast<float>(scales[base / 16]));
        _mm512_storeu_ps(out + base, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(codes)));
      }
    }
  }
}

template <BlockType kType>
PS_AVX512 void decode_blocks_avx512(const uint8_t* blocks, int64_t count, float* out) {
  for (int64_t blk = 0; blk < count; ++blk) {
    if constexpr (kBlock32<kType>) {
      __m512 w0, w1;
      load_block32_avx512<kType>(blocks, blk, w0, w1);
      _mm512_storeu_ps(out + blk * 32, w0);
      _mm512_storeu_ps(out + blk * 32 + 16, w1);
    }
    if constexpr (kType == BlockType::kQ4_K) {
      const uint8_t* b = blocks + blk * 144;
      decode_k4_avx512<false>(b, nullptr, b + 16, out + blk * 256);
    }
    if constexpr (kType == BlockType::kQ5_K) {
      const uint8_t* b = blocks + blk * 176;
      decode_k4_avx512<true>(b, b + 16, b + 48, out + blk * 256);
    }
    if constexpr (kType == BlockType::kQ6_K) decode_q6_k_avx512(blocks + blk * 210, out + blk * 256);
  }
}

#undef PS_AVX512

}  // namespace pagedserve::ops::gguf

#endif
