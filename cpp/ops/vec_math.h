// Branch-free float math that vectorizes with baseline SSE2.
//
// std::exp is an opaque libm call, so a loop that calls it stays scalar; the
// softmax and SiLU loops call exp_approx instead. Accuracy: relative error
// below 3e-7 (about 2 ulp) on [-87.3, 88.3]; exactly 0 below that range
// (softmax masks rely on exp(-inf) == 0), +inf above ln(FLT_MAX), NaN for NaN.
#pragma once

#include <bit>
#include <cstdint>
#include <limits>

#include "ops/float_types.h"

namespace pagedserve::ops {

// cond ? if_set : if_clear, as bit operations (see mask_if): std::min/max or a
// ternary on floats followed by more float math keeps GCC's loop scalar.
PS_ALWAYS_INLINE float select_float(bool cond, float if_set, float if_clear) {
  return std::bit_cast<float>(
      select_bits(mask_if(cond), std::bit_cast<uint32_t>(if_set), std::bit_cast<uint32_t>(if_clear)));
}

PS_ALWAYS_INLINE float exp_approx(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  // ln 2 split so that n * kLn2High is exact for |n| < 2^10 (Cody-Waite reduction).
  constexpr float kLn2High = 0.693145751953125f;
  constexpr float kLn2Low = 1.42860682030941723212e-6f;
  // Adding 1.5 * 2^23 rounds to an integer and leaves it in the low mantissa bits.
  constexpr float kRoundShift = 12582912.0f;
  constexpr float kSmallest = -87.33654475f;  // ln(2^-126): below, the answer is 0
  constexpr float kLargest = 88.37626266f;    // 127.5 * ln 2: keeps 2^n finite
  constexpr float kOverflow = 88.72283905f;   // ln(FLT_MAX): above, the answer is inf

  // Everything is computed unconditionally and the edge cases are blended in
  // with bit masks: a float operation under a branch would keep the loop
  // scalar (the compiler may not speculate it under -ftrapping-math).
  const float at_least_smallest = select_float(x < kSmallest, kSmallest, x);
  const float clamped = select_float(at_least_smallest > kLargest, kLargest, at_least_smallest);
  const float shifted = clamped * kLog2e + kRoundShift;
  const float n = shifted - kRoundShift;
  const float r = (clamped - n * kLn2High) - n * kLn2Low;  // |r| <= ln(2) / 2

  // exp(r) by its Taylor series to degree 7 (truncation error < 1e-8 on |r| <= 0.347).
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;

  const int32_t exponent = std::bit_cast<int32_t>(shifted) - std::bit_cast<int32_t>(kRoundShift);
  const float two_to_n = std::bit_cast<float>(static_cast<uint32_t>(exponent + 127) << 23);
  const uint32_t result = std::bit_cast<uint32_t>(p * two_to_n);

  const uint32_t infinity = std::bit_cast<uint32_t>(std::numeric_limits<float>::infinity());
  uint32_t bits = result & ~mask_if(x < kSmallest);
  bits = select_bits(mask_if(x > kOverflow), infinity, bits);
  bits = select_bits(mask_if(x != x), std::bit_cast<uint32_t>(x), bits);  // NaN in, NaN out
  return std::bit_cast<float>(bits);
}

// Sums with kLanes independent partial sums: a plain `sum += x[i]` loop is a
// serial dependency chain the compiler may not reorder (no -ffast-math).
// 16 lanes fill one AVX-512 register or two AVX2 ones (8 lanes made GCC's
// AVX-512 code for long rows three times slower).
inline constexpr int kLanes = 16;

template <int kCount>
PS_ALWAYS_INLINE float sum_lanes(const float (&lanes)[kCount]) {
  float total = 0.0f;
  for (float lane : lanes) total += lane;
  return total;
}

// tanh, branch-free like exp_approx (for attention logit soft-capping):
// absolute error below 3e-7. Near 0 the odd Taylor series to x^15 (error
// < 3e-8 for |x| < 0.55, where 1 - 2 / (e^2x + 1) would cancel); beyond it
// that formula, which saturates to +-1 for large |x| (exp_approx gives inf).
PS_ALWAYS_INLINE float tanh_approx(float x) {
  const float ax = select_float(x < 0.0f, -x, x);
  const float x2 = x * x;
  // Horner in x^2 from the x^15 coefficient down to x^1.
  float series = -929569.0f / 638512875.0f;
  series = series * x2 + 21844.0f / 6081075.0f;
  series = series * x2 - 1382.0f / 155925.0f;
  series = series * x2 + 62.0f / 2835.0f;
  series = series * x2 - 17.0f / 315.0f;
  series = series * x2 + 2.0f / 15.0f;
  series = series * x2 - 1.0f / 3.0f;
  series = series * x2 + 1.0f;
  series *= x;
  const float magnitude = 1.0f - 2.0f / (exp_approx(2.0f * ax) + 1.0f);
  const float far = select_float(x < 0.0f, -magnitude, magnitude);
  return select_float(ax < 0.55f, series, far);
}

// SiLU (swish): x * sigmoid(x).
PS_ALWAYS_INLINE float silu(float x) { return x / (1.0f + exp_approx(-x)); }

}  // namespace pagedserve::ops
