// Float conversions (bf16 / fp16 <-> float) and exp_approx against independent oracles.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>

#include "ops/float_types.h"
#include "ops/vec_math.h"
#include "ops_test_util.h"

namespace pagedserve::ops {
namespace {

// ---------------------------------------------------------------------------
// Half: GCC's _Float16 (soft-float conversions in libgcc) is the oracle.

TEST(FloatTypes, HalfToFloatMatchesCompilerForEveryBitPattern) {
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const float ours = half_to_float(Half{static_cast<uint16_t>(bits)});
    const float oracle = static_cast<float>(std::bit_cast<_Float16>(static_cast<uint16_t>(bits)));
    if (std::isnan(oracle)) {
      ASSERT_TRUE(std::isnan(ours)) << std::hex << bits;
    } else {
      ASSERT_EQ(std::bit_cast<uint32_t>(ours), std::bit_cast<uint32_t>(oracle)) << std::hex << bits;
    }
  }
}

void expect_half_rounding_matches(float value) {
  const uint16_t ours = float_to_half(value).bits;
  const auto oracle = std::bit_cast<uint16_t>(static_cast<_Float16>(value));
  if (std::isnan(value)) {
    EXPECT_EQ(ours & 0x7c00, 0x7c00) << value;
    EXPECT_NE(ours & 0x03ff, 0) << value;
  } else {
    EXPECT_EQ(ours, oracle) << "value " << value << " bits " << std::hex << std::bit_cast<uint32_t>(value);
  }
}

TEST(FloatTypes, FloatToHalfRoundsToNearestEven) {
  for (float v : {0.0f, -0.0f, 1.0f, -2.5f, 65504.0f, 65519.99f, 65520.0f, 1e6f, -1e6f, 6.1035156e-05f,
                  5.9604645e-08f, 2.9802322e-08f, 2.9802326e-08f, 1e-9f, 0.33333334f,
                  std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min()}) {
    expect_half_rounding_matches(v);
  }
  // Every halfway point between adjacent halves (ties go to even), and its neighbours.
  for (uint32_t h = 0; h < 0x7bff; h += 7) {
    const double low = half_to_float(Half{static_cast<uint16_t>(h)});
    const double high = half_to_float(Half{static_cast<uint16_t>(h + 1)});
    const auto mid = static_cast<float>((low + high) / 2);
    expect_half_rounding_matches(mid);
    expect_half_rounding_matches(std::nextafter(mid, 0.0f));
    expect_half_rounding_matches(std::nextafter(mid, 1e9f));
  }
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> any_bits;
  for (int i = 0; i < 200000; ++i) expect_half_rounding_matches(std::bit_cast<float>(any_bits(rng)));
}

// bfloat16: the oracle picks the nearer of the two neighbouring bf16 values in double.
uint16_t bf16_oracle(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t down = bits & 0xffff0000u;
  const uint32_t up = down + 0x10000u;
  // Past the largest bf16, IEEE rounding measures the distance to 2^128 and lands on infinity.
  const double up_value =
      (up & 0x7f800000u) == 0x7f800000u ? std::copysign(0x1p128, value) : std::bit_cast<float>(up);
  const double d_down = std::abs(static_cast<double>(std::bit_cast<float>(down)) - value);
  const double d_up = std::abs(up_value - value);
  if (d_down < d_up || (d_down == d_up && ((down >> 16) & 1u) == 0)) return static_cast<uint16_t>(down >> 16);
  return static_cast<uint16_t>(up >> 16);
}

TEST(FloatTypes, FloatToBFloat16RoundsToNearestEven) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<uint32_t> any_bits;
  for (int i = 0; i < 200000; ++i) {
    const float v = std::bit_cast<float>(any_bits(rng) & 0xff7fffffu);  // finite values
    if (std::isnan(v) || std::isinf(v)) continue;
    ASSERT_EQ(float_to_bf16(v).bits, bf16_oracle(v)) << v;
  }
  EXPECT_EQ(float_to_bf16(1.00390625f).bits, 0x3f80);  // exactly halfway, even below
  EXPECT_EQ(float_to_bf16(1.01171875f).bits, 0x3f82);  // exactly halfway, even above
  EXPECT_EQ(bf16_to_float(float_to_bf16(-3.0f)), -3.0f);
  const uint16_t nan = float_to_bf16(std::numeric_limits<float>::quiet_NaN()).bits;
  EXPECT_TRUE(std::isnan(bf16_to_float(BFloat16{nan})));
  // A NaN whose payload sits only in the low bits must not round into infinity.
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::bit_cast<float>(0x7f800001u)))));
  EXPECT_TRUE(std::isinf(bf16_to_float(float_to_bf16(std::numeric_limits<float>::infinity()))));
}

// ---------------------------------------------------------------------------

TEST(VecMath, ExpApproxIsAccurate) {
  double worst = 0;
  for (double x = -87.0; x <= 88.0; x += 0.001234) {
    const float xf = static_cast<float>(x);
    const double exact = std::exp(static_cast<double>(xf));
    worst = std::max(worst, std::abs(exp_approx(xf) - exact) / exact);
  }
  EXPECT_LT(worst, 3e-7);
  EXPECT_EQ(exp_approx(0.0f), 1.0f);
  EXPECT_EQ(exp_approx(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_EQ(exp_approx(-200.0f), 0.0f);
  EXPECT_TRUE(std::isinf(exp_approx(100.0f)));
  EXPECT_NEAR(silu(3.0f), 3.0 / (1.0 + std::exp(-3.0)), 1e-6);
  EXPECT_EQ(silu(-200.0f), 0.0f);
}

}  // namespace
}  // namespace pagedserve::ops
