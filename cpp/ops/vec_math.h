// Branch-free float math that vectorizes with baseline SSE2.
//
// std::exp is an opaque libm call, so a loop that calls it stays scalar; the
// softmax and SiLU loops call exp_approx instead. Accuracy: relative error
// below 3e-7 (about 2 ulp) on [-87.3, 88.3]; exactly 0 below that range
// (softmax masks rely on exp(-inf) == 0) and +inf above ln(FLT_MAX).
#pragma once

#include <bit>
#include <cstdint>
#include <limits>

namespace pagedserve::ops {

inline float exp_approx(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  // ln 2 split so that n * kLn2High is exact for |n| < 2^10 (Cody-Waite reduction).
  constexpr float kLn2High = 0.693145751953125f;
  constexpr float kLn2Low = 1.42860682030941723212e-6f;
  // Adding 1.5 * 2^23 rounds to an integer and leaves it in the low mantissa bits.
  constexpr float kRoundShift = 12582912.0f;
  constexpr float kSmallest = -87.33654475f;  // ln(2^-126): below, the answer is 0
  constexpr float kLargest = 88.37626266f;    // 127.5 * ln 2: keeps 2^n finite
  constexpr float kOverflow = 88.72283905f;   // ln(FLT_MAX): above, the answer is inf

  const float clamped = x < kSmallest ? kSmallest : (x > kLargest ? kLargest : x);
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
  const float result = p * two_to_n;
  const float low = x < kSmallest ? 0.0f : result;
  return x > kOverflow ? std::numeric_limits<float>::infinity() : low;
}

// Sums with kLanes independent partial sums: a plain `sum += x[i]` loop is a
// serial dependency chain the compiler may not reorder (no -ffast-math).
inline constexpr int kLanes = 8;

inline float sum_lanes(const float (&lanes)[kLanes]) {
  float total = 0.0f;
  for (float lane : lanes) total += lane;
  return total;
}

// SiLU (swish): x * sigmoid(x).
inline float silu(float x) { return x / (1.0f + exp_approx(-x)); }

}  // namespace pagedserve::ops
