// Storage types for 16-bit floats and their conversions to and from float.
//
// BFloat16 and Half are plain 16-bit containers: kernels load them into
// float32, compute in float32 and round once on the way back. Every
// conversion is written with integer bit operations and masked selects, no
// branches, so the loops that call them vectorize at every ISA level
// (cpu_isa.h), baseline SSE2 included.
#pragma once

#include <bit>
#include <cstdint>
#include <type_traits>

#include "ops/cpu_isa.h"

namespace pagedserve::ops {

struct BFloat16 {
  uint16_t bits;
};

struct Half {
  uint16_t bits;
};

static_assert(sizeof(BFloat16) == 2 && sizeof(Half) == 2);

// All ones when cond holds, else zero: selects as bit operations. (A ternary
// here lets the compiler turn the select back into a branch and sink the
// float math of one side into it, which keeps the loop scalar.)
PS_ALWAYS_INLINE uint32_t mask_if(bool cond) { return 0u - static_cast<uint32_t>(cond); }

PS_ALWAYS_INLINE uint32_t select_bits(uint32_t mask, uint32_t if_set, uint32_t if_clear) {
  return (if_set & mask) | (if_clear & ~mask);
}

// ---------------------------------------------------------------------------
// bfloat16: the upper half of a float32.

PS_ALWAYS_INLINE float bf16_to_float(BFloat16 value) { return std::bit_cast<float>(uint32_t{value.bits} << 16); }

// Round to nearest, ties to even; NaNs stay NaN (quieted) instead of rounding into infinity.
PS_ALWAYS_INLINE BFloat16 float_to_bf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t lsb = (bits >> 16) & 1u;
  const uint32_t rounded = (bits + 0x7fffu + lsb) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x0040u;
  const auto magnitude = static_cast<int32_t>(bits & 0x7fffffffu);
  return BFloat16{static_cast<uint16_t>(select_bits(mask_if(magnitude > 0x7f800000), quiet_nan, rounded))};
}

// ---------------------------------------------------------------------------
// IEEE 754 binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits.

inline constexpr uint32_t kFloatHalfBiasDelta = (127 - 15) << 23;

// Both paths are computed and blended with a mask (no branch), so loops over
// halves vectorize.
PS_ALWAYS_INLINE float half_to_float(Half value) {
  const uint32_t h = value.bits;
  const uint32_t exponent = h & 0x7c00u;
  // Normal numbers: move exponent and mantissa into float position and rebias.
  // Inf/NaN (exponent all ones) need the float exponent all ones too: rebias twice.
  const uint32_t shifted = (h & 0x7fffu) << 13;
  const uint32_t normal = shifted + kFloatHalfBiasDelta + (kFloatHalfBiasDelta & mask_if(exponent == 0x7c00u));
  // Zero and subnormals: mantissa * 2^-24, exact in float.
  const uint32_t subnormal = std::bit_cast<uint32_t>(static_cast<float>(static_cast<int32_t>(h & 0x03ffu)) * 0x1p-24f);
  const uint32_t magnitude = select_bits(mask_if(exponent == 0), subnormal, normal);
  return std::bit_cast<float>(magnitude | ((h & 0x8000u) << 16));
}

// Round to nearest, ties to even; overflow goes to infinity, NaNs stay NaN.
// Branch-free like half_to_float: every case is computed, then selected.
PS_ALWAYS_INLINE Half float_to_half(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const auto magnitude = static_cast<int32_t>(bits & 0x7fffffffu);  // signed: SSE2 compares are signed
  // Normal halves (>= 2^-14): rebias the exponent, round the mantissa from 23 to 10 bits.
  const uint32_t rebiased = static_cast<uint32_t>(magnitude) - kFloatHalfBiasDelta;
  const uint32_t normal = (rebiased + 0x0fffu + ((rebiased >> 13) & 1u)) >> 13;
  // Subnormal halves count units of 2^-24, which is the ulp of floats in [0.5, 1):
  // adding 0.5 makes the FPU round |value| to whole units, left in the low bits.
  const float aligned = std::bit_cast<float>(magnitude) + 0.5f;
  const uint32_t subnormal = std::bit_cast<uint32_t>(aligned) - std::bit_cast<uint32_t>(0.5f);
  uint32_t result = select_bits(mask_if(magnitude < 0x38800000), subnormal, normal);
  // 65520 = 65504 + half an ulp is the first value that rounds (to even) up to infinity.
  result = select_bits(mask_if(magnitude >= 0x477ff000), 0x7c00u, result);
  result = select_bits(mask_if(magnitude > 0x7f800000), 0x7e00u, result);
  return Half{static_cast<uint16_t>(sign | result)};
}

// ---------------------------------------------------------------------------
// Uniform access for templated kernels: to_float(x) and from_float<T>(f).

PS_ALWAYS_INLINE float to_float(float value) { return value; }
PS_ALWAYS_INLINE float to_float(BFloat16 value) { return bf16_to_float(value); }
PS_ALWAYS_INLINE float to_float(Half value) { return half_to_float(value); }

template <typename T>
PS_ALWAYS_INLINE T from_float(float value) {
  if constexpr (std::is_same_v<T, float>) {
    return value;
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    return float_to_bf16(value);
  } else {
    static_assert(std::is_same_v<T, Half>, "from_float: unsupported storage type");
    return float_to_half(value);
  }
}

// Rounds a float to T's precision and back: what storing and reloading it would give.
template <typename T>
PS_ALWAYS_INLINE float round_to(float value) {
  return to_float(from_float<T>(value));
}

}  // namespace pagedserve::ops
