// pack_linear_weight and packed_linear against float64 loops over the
// bf16-rounded weights, at every instruction set, on shapes that cut tiles
// and row blocks unevenly; the layout against packed_weight_layout.h.
#include <gtest/gtest.h>

#include <optional>
#include <tuple>

#include "ops/ops.h"
#include "ops/packed_weight_layout.h"
#include "ops_test_util.h"

namespace pagedserve::ops {
namespace {

using testing::HostTensor;
using testing::all_close;
using testing::as_double;
using testing::random_tensor;
using testing::throws_invalid;

HostTensor<BFloat16> pack(const TensorView& weight) {
  HostTensor<BFloat16> packed({packed_col_tiles(weight.size(0)), packed_k_pairs(weight.size(1)), 2 * kPackedCols});
  for (auto& v : packed.data) v = BFloat16{0xffff};  // NaN poison: padding must be written as zero
  pack_linear_weight(packed.view(), weight);
  return packed;
}

// out[m, n] = sum_k x[m, k] * bf16(w[n, k]) (+ bias[n]), in float64.
std::vector<double> linear_oracle(const HostTensor<float>& x, const HostTensor<float>& w,
                                  const std::optional<HostTensor<float>>& bias) {
  const int64_t rows = x.shape[0], in = x.shape[1], out = w.shape[0];
  std::vector<double> y(static_cast<size_t>(rows * out));
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t n = 0; n < out; ++n) {
      double sum = bias ? double{(*bias)[n]} : 0.0;
      for (int64_t k = 0; k < in; ++k) sum += double{x[m * in + k]} * as_double(float_to_bf16(w[n * in + k]));
      y[static_cast<size_t>(m * out + n)] = sum;
    }
  }
  return y;
}

TEST(PackedLinear, LayoutPairsKAndZeroPads) {
  std::mt19937 rng(7);
  const HostTensor<float> w = random_tensor<float>({20, 35}, rng);  // 2 column tiles (12 short), K padded to 64
  const HostTensor<BFloat16> packed = pack(w.view());
  ASSERT_EQ(packed.numel(), 2 * 32 * 32);
  for (int64_t n = 0; n < 32; ++n) {
    for (int64_t k = 0; k < 64; ++k) {
      const double expected = n < 20 && k < 35 ? as_double(float_to_bf16(w[n * 35 + k])) : 0.0;
      EXPECT_EQ(as_double(packed[packed_weight_offset(n, k, 35)]), expected) << "n=" << n << " k=" << k;
    }
  }
  // Row p of a tile holds (W[c, 2p], W[c, 2p + 1]) for its 16 columns c in turn.
  EXPECT_EQ(packed_weight_offset(0, 1, 35), 1);
  EXPECT_EQ(packed_weight_offset(5, 0, 35), 10);
  EXPECT_EQ(packed_weight_offset(5, 3, 35), 32 + 11);
  EXPECT_EQ(packed_weight_offset(16, 0, 35), 32 * 32);
}

TEST(PackedLinear, MatchesFloat64LoopsOnEveryIsa) {
  std::mt19937 rng(11);
  testing::for_each_cpu_isa([&] {
    for (auto [rows, out, in] : {std::tuple<int64_t, int64_t, int64_t>{1, 32, 64}, {3, 33, 7}, {12, 96, 576},
                                 {13, 31, 40}, {16, 960, 576}, {25, 100, 1}, {130, 70, 96}, {0, 32, 8}}) {
      for (bool with_bias : {false, true}) {
        SCOPED_TRACE("rows " + std::to_string(rows) + " out " + std::to_string(out) + " in " + std::to_string(in) +
                     (with_bias ? " bias" : ""));
        const HostTensor<float> x = random_tensor<float>({rows, in}, rng);
        const HostTensor<float> w = random_tensor<float>({out, in}, rng, 0.1f);
        std::optional<HostTensor<float>> bias;
        if (with_bias) bias = random_tensor<float>({out}, rng);
        const HostTensor<BFloat16> packed = pack(w.view());
        HostTensor<float> y({rows, out});
        std::optional<TensorView> bias_view;
        if (bias) bias_view = bias->view();
        packed_linear(y.view(), x.view(), packed.view(), bias_view);
        // Float32 accumulation over K terms: allow a few roundings per sqrt(K).
        EXPECT_TRUE(all_close(y, linear_oracle(x, w, bias), 1.0 + static_cast<double>(in) / 64.0));
      }
    }
  });
}

TEST(PackedLinear, SingleAndMultiThreadedAgreeBitForBit) {
  std::mt19937 rng(3);
  const HostTensor<float> x = random_tensor<float>({40, 576}, rng);
  const HostTensor<float> w = random_tensor<float>({1000, 576}, rng, 0.05f);
  const HostTensor<BFloat16> packed = pack(w.view());
  HostTensor<float> threaded({40, 1000}), single({40, 1000});
  const int before = num_threads();
  set_num_threads(4);
  packed_linear(threaded.view(), x.view(), packed.view(), std::nullopt);
  set_num_threads(1);
  packed_linear(single.view(), x.view(), packed.view(), std::nullopt);
  set_num_threads(before);
  EXPECT_EQ(threaded.data, single.data);
}

TEST(PackedLinear, RejectsBadArguments) {
  std::mt19937 rng(5);
  const HostTensor<float> x = random_tensor<float>({4, 64}, rng);
  const HostTensor<float> w = random_tensor<float>({48, 64}, rng);
  const HostTensor<BFloat16> packed = pack(w.view());
  HostTensor<float> y({4, 48});
  const HostTensor<BFloat16> x_bf16({4, 64});
  EXPECT_TRUE(throws_invalid([&] { packed_linear(y.view(), x_bf16.view(), packed.view(), std::nullopt); },
                             "packed_linear: x"));
  const HostTensor<float> x_wrong_k = random_tensor<float>({4, 100}, rng);  // pads to 128, not 64
  EXPECT_TRUE(throws_invalid([&] { packed_linear(y.view(), x_wrong_k.view(), packed.view(), std::nullopt); },
                             "packed_weight"));
  HostTensor<float> y_wrong_n({4, 80});  // needs 5 column tiles, the weight has 3
  EXPECT_TRUE(throws_invalid([&] { packed_linear(y_wrong_n.view(), x.view(), packed.view(), std::nullopt); },
                             "packed_weight"));
  const HostTensor<float> short_bias({47});
  EXPECT_TRUE(throws_invalid([&] { packed_linear(y.view(), x.view(), packed.view(), short_bias.view()); },
                             "packed_linear: bias"));
  HostTensor<BFloat16> wrong_packed({3, 64, 32});  // K = 64 needs 32 pair rows
  EXPECT_TRUE(throws_invalid([&] { pack_linear_weight(wrong_packed.view(), w.view()); }, "packed_weight"));
}

}  // namespace
}  // namespace pagedserve::ops
