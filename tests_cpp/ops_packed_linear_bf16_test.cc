// packed_linear_bf16 against float64 loops over the bf16-rounded x and W, at
// every instruction set this CPU has (amx_bf16 where AMX is, avx512_bf16,
// and the widened avx512 / avx2 / baseline kernels), on shapes that cut
// column tiles, K chunks and row blocks unevenly; float32 and bf16 x and out;
// 1 vs N threads and 1 vs M rows bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "ops/cpu_isa.h"
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

HostTensor<BFloat16> to_bf16(const HostTensor<float>& x) {
  HostTensor<BFloat16> y(x.shape);
  for (int64_t i = 0; i < x.numel(); ++i) y.data[static_cast<size_t>(i)] = float_to_bf16(x.data[static_cast<size_t>(i)]);
  return y;
}

// Every output against sum_k bf16(x) bf16(w) (+ bias) in float64, within the
// float32 summation bound K * 2^-24 * sum_k |x w| (plus one bf16 rounding of
// the result when out is bf16).
template <typename Out>
::testing::AssertionResult matches_oracle(const HostTensor<Out>& y, const HostTensor<float>& x,
                                          const HostTensor<float>& w, const std::optional<HostTensor<float>>& bias) {
  const int64_t rows = x.shape[0], in = x.shape[1], out = w.shape[0];
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t n = 0; n < out; ++n) {
      double sum = bias ? double{(*bias)[n]} : 0.0, magnitude = std::abs(sum);
      for (int64_t k = 0; k < in; ++k) {
        const double term = as_double(float_to_bf16(x[m * in + k])) * as_double(float_to_bf16(w[n * in + k]));
        sum += term;
        magnitude += std::abs(term);
      }
      double bound = static_cast<double>(in + 2) * std::ldexp(magnitude, -24) + 1e-30;
      if constexpr (std::is_same_v<Out, BFloat16>) bound += std::ldexp(std::abs(sum), -8);
      const double got = as_double(y[m * out + n]);
      if (!(std::abs(got - sum) <= bound)) {
        return ::testing::AssertionFailure() << "row " << m << " col " << n << ": got " << got << ", expected "
                                             << sum << " (bound " << bound << ")";
      }
    }
  }
  return ::testing::AssertionSuccess();
}

using Shape = std::tuple<int64_t, int64_t, int64_t>;  // rows, out, in
const Shape kShapes[] = {{1, 32, 64},  {3, 33, 7},   {1, 960, 576}, {12, 96, 576}, {17, 31, 40},
                         {16, 100, 1}, {130, 70, 96}, {0, 32, 8},   {25, 17, 100}};

TEST(PackedLinearBf16, MatchesFloat64LoopsOnEveryIsa) {
  std::mt19937 rng(11);
  testing::for_each_cpu_isa([&] {
    SCOPED_TRACE(std::string("kernel ") + std::string(packed_linear_bf16_kernel()));
    for (auto [rows, out, in] : kShapes) {
      for (bool with_bias : {false, true}) {
        SCOPED_TRACE("rows " + std::to_string(rows) + " out " + std::to_string(out) + " in " + std::to_string(in) +
                     (with_bias ? " bias" : ""));
        const HostTensor<float> x = random_tensor<float>({rows, in}, rng);
        const HostTensor<float> w = random_tensor<float>({out, in}, rng, 0.1f);
        std::optional<HostTensor<float>> bias;
        std::optional<TensorView> bias_view;
        if (with_bias) {
          bias = random_tensor<float>({out}, rng);
          bias_view = bias->view();
        }
        const HostTensor<BFloat16> packed = packed_bf16_tiles(w);
        HostTensor<float> y({rows, out});
        packed_linear_bf16(y.view(), x.view(), packed.view(), bias_view);
        EXPECT_TRUE(matches_oracle(y, x, w, bias));
        // bf16 x gives the same float32 result as float32 x rounded inside.
        HostTensor<float> y_from_bf16({rows, out});
        packed_linear_bf16(y_from_bf16.view(), to_bf16(x).view(), packed.view(), bias_view);
        EXPECT_EQ(y_from_bf16.data, y.data);
        // bf16 out is the float32 result rounded once.
        HostTensor<BFloat16> y_bf16({rows, out});
        packed_linear_bf16(y_bf16.view(), x.view(), packed.view(), bias_view);
        EXPECT_EQ(to_bf16(y).data.size(), y_bf16.data.size());
        for (size_t i = 0; i < y.data.size(); ++i) ASSERT_EQ(float_to_bf16(y.data[i]).bits, y_bf16.data[i].bits);
      }
    }
  });
}

TEST(PackedLinearBf16, NamesItsKernel) {
  const CpuIsa before = cpu_isa();
  set_cpu_isa(CpuIsa::kBaseline);
  EXPECT_EQ(packed_linear_bf16_kernel(), "baseline_widened");
  if (best_supported_cpu_isa() >= CpuIsa::kAvx512Bf16) {
    set_cpu_isa(CpuIsa::kAvx512Bf16);
    EXPECT_EQ(packed_linear_bf16_kernel(), "avx512_bf16");
  }
  if (best_supported_cpu_isa() == CpuIsa::kAmx) {
    set_cpu_isa(CpuIsa::kAmx);
    EXPECT_EQ(packed_linear_bf16_kernel(), "amx_bf16");
  }
  set_cpu_isa(before);
}

// Threads split column tiles only, and a row never shares a K sum with
// another: 1 vs 4 threads and row r alone vs inside a batch agree bit for bit.
TEST(PackedLinearBf16, ThreadsAndBatchesAgreeBitForBit) {
  std::mt19937 rng(3);
  const HostTensor<float> x = random_tensor<float>({40, 576}, rng);
  const HostTensor<float> w = random_tensor<float>({1000, 576}, rng, 0.05f);
  const HostTensor<BFloat16> packed = packed_bf16_tiles(w);
  testing::for_each_cpu_isa([&] {
    HostTensor<float> threaded({40, 1000}), single({40, 1000});
    const int before = num_threads();
    set_num_threads(4);
    packed_linear_bf16(threaded.view(), x.view(), packed.view(), std::nullopt);
    set_num_threads(1);
    packed_linear_bf16(single.view(), x.view(), packed.view(), std::nullopt);
    set_num_threads(before);
    EXPECT_EQ(threaded.data, single.data);
    for (int64_t row : {0, 13, 39}) {
      HostTensor<float> x_row({1, 576}), y_row({1, 1000});
      std::copy(x.data.begin() + row * 576, x.data.begin() + (row + 1) * 576, x_row.data.begin());
      packed_linear_bf16(y_row.view(), x_row.view(), packed.view(), std::nullopt);
      EXPECT_TRUE(std::equal(y_row.data.begin(), y_row.data.end(), single.data.begin() + row * 1000)) << row;
    }
  });
}

TEST(PackedLinearBf16, RejectsBadArguments) {
  std::mt19937 rng(5);
  const HostTensor<float> x = random_tensor<float>({4, 64}, rng);
  const HostTensor<BFloat16> packed = packed_bf16_tiles(random_tensor<float>({48, 64}, rng));
  HostTensor<float> y({4, 48});
  const HostTensor<Half> x_half({4, 64});
  EXPECT_TRUE(throws_invalid([&] { packed_linear_bf16(y.view(), x_half.view(), packed.view(), std::nullopt); },
                             "packed_linear_bf16: x must be float32 or bfloat16"));
  HostTensor<float> y_wrong_n({4, 80});
  EXPECT_TRUE(throws_invalid([&] { packed_linear_bf16(y_wrong_n.view(), x.view(), packed.view(), std::nullopt); },
                             "packed_weight"));
  const HostTensor<float> short_bias({47});
  EXPECT_TRUE(throws_invalid([&] { packed_linear_bf16(y.view(), x.view(), packed.view(), short_bias.view()); },
                             "packed_linear_bf16: bias"));
}

}  // namespace
}  // namespace pagedserve::ops
