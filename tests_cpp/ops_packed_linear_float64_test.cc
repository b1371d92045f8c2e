// packed_linear_float64_sums: the sums against float64 loops in the kernels'
// order (even k and odd k apart, then added), bit for bit at every ISA; what makes it worth having (a sum split
// over K in two, the halves added, rounds as the whole sum does, where
// float32 sums do not); its argument checks.
#include <gtest/gtest.h>

#include <optional>
#include <tuple>

#include "ops/ops.h"
#include "ops/packed_weight_layout.h"
#include "ops_test_util.h"

namespace pagedserve::ops {
namespace {

using testing::HostTensor;
using testing::as_double;
using testing::packed_bf16_tiles;
using testing::random_tensor;
using testing::throws_invalid;

// Columns [begin, end) of w [N, K], as its own [N, end - begin] matrix.
HostTensor<float> columns(const HostTensor<float>& w, int64_t begin, int64_t end) {
  const int64_t rows = w.shape[0], k = w.shape[1];
  HostTensor<float> out({rows, end - begin});
  for (int64_t n = 0; n < rows; ++n) {
    for (int64_t c = begin; c < end; ++c) out[n * (end - begin) + c - begin] = w[n * k + c];
  }
  return out;
}

TEST(PackedLinearFloat64Sums, EqualsFloat64LoopsOnEveryIsa) {
  std::mt19937 rng(17);
  testing::for_each_cpu_isa([&] {
    for (auto [rows, out, in] : {std::tuple<int64_t, int64_t, int64_t>{1, 32, 64}, {3, 33, 7}, {7, 96, 576},
                                 {8, 31, 40}, {15, 100, 1}, {130, 70, 96}, {0, 32, 8}}) {
      SCOPED_TRACE("rows " + std::to_string(rows) + " out " + std::to_string(out) + " in " + std::to_string(in));
      const HostTensor<float> x = random_tensor<float>({rows, in}, rng);
      const HostTensor<float> w = random_tensor<float>({out, in}, rng, 0.1f);
      const HostTensor<float> bias = random_tensor<float>({out}, rng);
      const HostTensor<BFloat16> packed = packed_bf16_tiles(w);
      HostTensor<double> sums({rows, out});
      HostTensor<float> rounded({rows, out});
      packed_linear_float64_sums(sums.view(), x.view(), packed.view(), std::nullopt);
      packed_linear_float64_sums(rounded.view(), x.view(), packed.view(), bias.view());
      for (int64_t m = 0; m < rows; ++m) {
        for (int64_t n = 0; n < out; ++n) {
          double sums_by_parity[2] = {0.0, 0.0};
          for (int64_t k = 0; k < in; ++k) {
            sums_by_parity[k % 2] += double{x[m * in + k]} * as_double(float_to_bf16(w[n * in + k]));
          }
          const double want = sums_by_parity[0] + sums_by_parity[1];
          ASSERT_EQ(sums[m * out + n], want) << "m=" << m << " n=" << n;
          ASSERT_EQ(rounded[m * out + n], static_cast<float>(want) + bias[n]) << "m=" << m << " n=" << n;
        }
      }
    }
  });
}

// What tensor parallelism does to a row-parallel product: each rank sums its share of K and the shares are
// added. In float64 the rounded result is the whole sum's; in float32 (packed_linear) it is not.
TEST(PackedLinearFloat64Sums, SplitSumsRoundAsTheWholeSum) {
  std::mt19937 rng(23);
  const int64_t rows = 6, out = 576, in = 576, split = 320;  // SmolLM2's o_proj, 5 + 4 heads of 64
  const HostTensor<float> x = random_tensor<float>({rows, in}, rng);
  const HostTensor<float> w = random_tensor<float>({out, in}, rng, 0.05f);
  HostTensor<float> x0({rows, split}), x1({rows, in - split});
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t k = 0; k < in; ++k) {
      (k < split ? x0[m * split + k] : x1[m * (in - split) + k - split]) = x[m * in + k];
    }
  }
  const HostTensor<BFloat16> whole = packed_bf16_tiles(w);
  const HostTensor<BFloat16> first = packed_bf16_tiles(columns(w, 0, split));
  const HostTensor<BFloat16> second = packed_bf16_tiles(columns(w, split, in));
  HostTensor<float> whole32({rows, out}), whole_f32_sums({rows, out}), part0_f32({rows, out}), part1_f32({rows, out});
  HostTensor<double> part0({rows, out}), part1({rows, out});
  packed_linear_float64_sums(whole32.view(), x.view(), whole.view(), std::nullopt);
  packed_linear_float64_sums(part0.view(), x0.view(), first.view(), std::nullopt);
  packed_linear_float64_sums(part1.view(), x1.view(), second.view(), std::nullopt);
  packed_linear(whole_f32_sums.view(), x.view(), whole.view(), std::nullopt);
  packed_linear(part0_f32.view(), x0.view(), first.view(), std::nullopt);
  packed_linear(part1_f32.view(), x1.view(), second.view(), std::nullopt);
  int64_t float32_differs = 0;
  for (int64_t i = 0; i < rows * out; ++i) {
    ASSERT_EQ(static_cast<float>(part0[i] + part1[i]), whole32[i]) << "output " << i;
    float32_differs += part0_f32[i] + part1_f32[i] != whole_f32_sums[i];
  }
  EXPECT_GT(float32_differs, rows * out / 10) << "float32 sums were meant to show the difference";
}

TEST(PackedLinearFloat64Sums, RejectsBadArguments) {
  std::mt19937 rng(5);
  const HostTensor<float> x = random_tensor<float>({4, 64}, rng);
  const HostTensor<float> w = random_tensor<float>({48, 64}, rng);
  const HostTensor<float> bias = random_tensor<float>({48}, rng);
  const HostTensor<BFloat16> packed = packed_bf16_tiles(w);
  HostTensor<double> sums({4, 48});
  EXPECT_TRUE(throws_invalid([&] { packed_linear_float64_sums(sums.view(), x.view(), packed.view(), bias.view()); },
                             "packed_linear_float64_sums: bias"));
  HostTensor<BFloat16> out_bf16({4, 48});
  EXPECT_TRUE(throws_invalid(
      [&] { packed_linear_float64_sums(out_bf16.view(), x.view(), packed.view(), std::nullopt); },
      "packed_linear_float64_sums: out must be float32 or float64"));
  const HostTensor<double> x64({4, 64});
  EXPECT_TRUE(throws_invalid([&] { packed_linear_float64_sums(sums.view(), x64.view(), packed.view(), std::nullopt); },
                             "packed_linear_float64_sums: x"));
  HostTensor<double> wrong_n({4, 80});  // 5 column tiles, the weight has 3
  EXPECT_TRUE(throws_invalid(
      [&] { packed_linear_float64_sums(wrong_n.view(), x.view(), packed.view(), std::nullopt); }, "packed_weight"));
}

}  // namespace
}  // namespace pagedserve::ops
