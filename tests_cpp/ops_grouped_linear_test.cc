// grouped_linear (mixture-of-experts products) against a float64 loop over
// each expert's rows, at every CPU instruction set.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "ops/ops.h"
#include "ops_test_util.h"

namespace pagedserve::ops {
namespace {

using testing::HostTensor;
using testing::as_double;
using testing::throws_invalid;

template <typename T>
struct GroupedProblem {
  HostTensor<T> x, weight, out;
  HostTensor<int32_t> offsets;

  GroupedProblem(const std::vector<int32_t>& counts, int64_t k, int64_t n, std::mt19937& rng, int32_t lead = 0,
                 int32_t tail = 0) {
    std::vector<int32_t> bounds{lead};
    for (int32_t c : counts) bounds.push_back(bounds.back() + c);
    const int64_t rows = bounds.back() + tail;
    offsets = testing::int_tensor({static_cast<int64_t>(bounds.size())}, bounds);
    x = testing::random_tensor<T>({rows, k}, rng);
    weight = testing::random_tensor<T>({static_cast<int64_t>(counts.size()), n, k}, rng, 0.1f);
    out = testing::full_tensor<T>({rows, n}, NAN);
  }

  void run() { grouped_linear(out.view(), x.view(), weight.view(), offsets.view()); }

  // Every row's expected output; NaN for rows outside the offsets.
  std::vector<double> oracle() const {
    const int64_t rows = x.shape[0], k = x.shape[1], n = weight.shape[1];
    std::vector<double> expected(static_cast<size_t>(rows * n), NAN);
    for (int64_t e = 0; e + 1 < offsets.numel(); ++e) {
      for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
        for (int64_t c = 0; c < n; ++c) {
          double sum = 0;
          for (int64_t i = 0; i < k; ++i) sum += as_double(x[r * k + i]) * as_double(weight[(e * n + c) * k + i]);
          expected[static_cast<size_t>(r * n + c)] = sum;
        }
      }
    }
    return expected;
  }
};

template <typename T>
::testing::AssertionResult matches(const GroupedProblem<T>& p) {
  std::vector<double> expected = p.oracle();
  HostTensor<T> routed = p.out;
  for (size_t i = 0; i < expected.size(); ++i) {
    const bool unrouted = std::isnan(expected[i]);
    if (unrouted != std::isnan(as_double(routed.data[i]))) return ::testing::AssertionFailure() << "index " << i;
    if (unrouted) {  // compare the routed rows only
      expected[i] = 0;
      routed.data[i] = from_float<T>(0.0f);
    }
  }
  return testing::all_close(routed, expected);
}

template <typename T>
class GroupedLinearTest : public ::testing::Test {
 protected:
  std::mt19937 rng_{77};
};
TYPED_TEST_SUITE(GroupedLinearTest, testing::FloatTypes);

TYPED_TEST(GroupedLinearTest, MatchesOracleOnRaggedExperts) {
  testing::for_each_cpu_isa([&] {
    GroupedProblem<TypeParam> a({5, 0, 70, 1}, 64, 40, this->rng_);
    a.run();
    EXPECT_TRUE(matches(a));
    GroupedProblem<TypeParam> b({0, 0, 130}, 37, 17, this->rng_, 3, 2);  // odd K and N, padding rows around
    b.run();
    EXPECT_TRUE(matches(b));
  });
}

TEST(GroupedLinear, LargeProblemOnThePool) {
  std::mt19937 rng(3);
  GroupedProblem<float> p({300, 7, 250}, 256, 96, rng);
  p.run();
  EXPECT_TRUE(matches(p));
}

TEST(GroupedLinear, PackedVariantMatchesOracleOnBf16Weights) {
  testing::for_each_cpu_isa([&] {
    std::mt19937 rng(9);
    GroupedProblem<float> p({3, 0, 40, 17}, 70, 33, rng, 1, 2);
    for (float& w : p.weight.data) w = bf16_to_float(float_to_bf16(w));  // the packed tiles' rounding
    HostTensor<BFloat16> packed({4, 3, 48, 32});  // [E, ceil(33 / 16), round_up(70, 32) / 2, 32]
    pack_grouped_weight(packed.view(), p.weight.view());
    packed_grouped_linear(p.out.view(), p.x.view(), packed.view(), p.offsets.view());
    EXPECT_TRUE(matches(p));
  });
}

TEST(GroupedLinear, RejectsBadOffsetsAndShapes) {
  std::mt19937 rng(4);
  GroupedProblem<float> p({4, 6}, 16, 8, rng);
  p.offsets[1] = 11;
  EXPECT_TRUE(throws_invalid([&] { p.run(); }, "expert_offsets must be non-decreasing"));
  p.offsets[1] = 4;
  p.offsets[2] = 11;
  EXPECT_TRUE(throws_invalid([&] { p.run(); }, "expert_offsets must be non-decreasing within [0, 10]"));
  p.offsets[2] = 10;
  HostTensor<float> wrong_out({10, 9});
  EXPECT_TRUE(throws_invalid(
      [&] { grouped_linear(wrong_out.view(), p.x.view(), p.weight.view(), p.offsets.view()); }, "out"));
  EXPECT_NO_THROW(p.run());
}

}  // namespace
}  // namespace pagedserve::ops
