// Storage types for 16-bit floats and their conversions to and from float.
//
// BFloat16 and Half are plain 16-bit containers: kernels load them into
// float32, compute in float32 and round once on the way back. Every
// conversion here is written with integer bit operations and selects rather
// than branches where it matters (loads), so the loops that call them
// vectorize with baseline x86-64 SSE2.
#pragma once

#include <bit>
#include <cstdint>
#include <type_traits>

namespace pagedserve::ops {

struct BFloat16 {
  uint16_t bits;
};

struct Half {
  uint16_t bits;
};

static_assert(sizeof(BFloat16) == 2 && sizeof(Half) == 2);

// ---------------------------------------------------------------------------
// bfloat16: the upper half of a float32.

inline float bf16_to_float(BFloat16 value) { return std::bit_cast<float>(uint32_t{value.bits} << 16); }

// Round to nearest, ties to even; NaNs stay NaN (quieted) instead of rounding into infinity.
inline BFloat16 float_to_bf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const bool is_nan = (bits & 0x7fffffffu) > 0x7f800000u;
  const uint32_t lsb = (bits >> 16) & 1u;
  const uint32_t rounded = (bits + 0x7fffu + lsb) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x0040u;
  return BFloat16{static_cast<uint16_t>(is_nan ? quiet_nan : rounded)};
}

// ---------------------------------------------------------------------------
// IEEE 754 binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits.

inline constexpr uint32_t kFloatHalfBiasDelta = (127 - 15) << 23;

inline float half_to_float(Half value) {
  const uint32_t h = value.bits;
  const uint32_t exponent = h & 0x7c00u;
  // Normal numbers: move exponent and mantissa into float position and rebias.
  // Inf/NaN (exponent all ones) need the float exponent all ones too: rebias twice.
  const uint32_t shifted = (h & 0x7fffu) << 13;
  const uint32_t normal = shifted + kFloatHalfBiasDelta + (exponent == 0x7c00u ? kFloatHalfBiasDelta : 0u);
  // Zero and subnormals: mantissa * 2^-24, exact in float.
  const float subnormal = static_cast<float>(h & 0x03ffu) * 0x1p-24f;
  const uint32_t magnitude = exponent == 0 ? std::bit_cast<uint32_t>(subnormal) : normal;
  return std::bit_cast<float>(magnitude | ((h & 0x8000u) << 16));
}

// Round to nearest, ties to even; overflow goes to infinity, NaNs stay NaN.
inline Half float_to_half(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return Half{static_cast<uint16_t>(sign | 0x7e00u)};
  // 65520 = 65504 + half an ulp is the first value that rounds (to even) up to infinity.
  if (magnitude >= 0x477ff000u) return Half{static_cast<uint16_t>(sign | 0x7c00u)};
  if (magnitude >= 0x38800000u) {  // >= 2^-14: a normal half
    const uint32_t rebiased = magnitude - kFloatHalfBiasDelta;
    const uint32_t rounded = rebiased + 0x0fffu + ((rebiased >> 13) & 1u);
    return Half{static_cast<uint16_t>(sign | (rounded >> 13))};
  }
  // A half subnormal counts units of 2^-24. With the implicit bit, the float is
  // mantissa * 2^(exponent - 150), i.e. mantissa >> (126 - exponent) units.
  const uint32_t exponent = magnitude >> 23;
  const uint32_t shift = 126u - exponent;
  if (shift > 24u) return Half{static_cast<uint16_t>(sign)};
  const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
  uint32_t units = mantissa >> shift;
  const uint32_t remainder = mantissa & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1u);
  if (remainder > halfway || (remainder == halfway && (units & 1u))) ++units;
  return Half{static_cast<uint16_t>(sign | units)};
}

// ---------------------------------------------------------------------------
// Uniform access for templated kernels: to_float(x) and from_float<T>(f).

inline float to_float(float value) { return value; }
inline float to_float(BFloat16 value) { return bf16_to_float(value); }
inline float to_float(Half value) { return half_to_float(value); }

template <typename T>
T from_float(float value) {
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
float round_to(float value) {
  return to_float(from_float<T>(value));
}

}  // namespace pagedserve::ops
