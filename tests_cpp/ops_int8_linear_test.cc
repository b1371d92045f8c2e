// int8_linear against float64 loops of the same quantization arithmetic: x
// quantized per 64-block of each row as int8_linear.cc defines it, each
// block's integer dot products in int64 (exact), dequantized in float64. Weights are packed here by a loop
// written from int8_weight_layout.h, independently of the Python packer.
// Every instruction set this CPU has (amx_int8 where AMX is, avx512_vnni, the
// integer loops), odd shapes, 1 vs N threads and 1 vs M rows bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "ops/cpu_isa.h"
#include "ops/int8_weight_layout.h"
#include "ops/ops.h"
#include "ops_test_util.h"

namespace pagedserve::ops {
namespace {

using testing::HostTensor;
using testing::random_tensor;
using testing::throws_invalid;

struct Int8Weight {
  std::vector<int8_t> q;  // [N, K]
  HostTensor<int32_t> packed;
  HostTensor<float> scales;
};

Int8Weight make_weight(int64_t out, int64_t in, std::mt19937& rng) {
  std::uniform_int_distribution<int> value(-127, 127);
  std::uniform_real_distribution<float> scale(1e-3f, 2e-2f);
  Int8Weight w{std::vector<int8_t>(static_cast<size_t>(out * in)),
               HostTensor<int32_t>({int8_col_tiles(out), int8_k_groups(in), kInt8Cols}), HostTensor<float>({out})};
  for (auto& v : w.q) v = static_cast<int8_t>(value(rng));
  auto* bytes = reinterpret_cast<uint8_t*>(w.packed.data.data());
  std::fill(bytes, bytes + w.packed.numel() * 4, uint8_t{128});  // the padding is q = 0
  for (int64_t n = 0; n < out; ++n) {
    w.scales.data[static_cast<size_t>(n)] = scale(rng);
    for (int64_t k = 0; k < in; ++k) {
      // byte j of packed[t, g, c] = q[16t + c, 4g + j] + 128
      const int64_t t = n / kInt8Cols, c = n % kInt8Cols, g = k / 4, j = k % 4;
      bytes[((t * int8_k_groups(in) + g) * kInt8Cols + c) * 4 + j] =
          static_cast<uint8_t>(w.q[static_cast<size_t>(n * in + k)] + 128);
    }
  }
  return w;
}

// The quantization int8_linear.cc documents, in the same float32 operations, for one block.
std::vector<int32_t> quantize(const float* x, int64_t size, float& scale) {
  float amax = 0.0f;
  for (int64_t k = 0; k < size; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  std::vector<int32_t> q(static_cast<size_t>(size));
  for (int64_t k = 0; k < size; ++k) {
    q[static_cast<size_t>(k)] = static_cast<int32_t>(std::clamp(std::nearbyint(x[k] * inv), -127.0f, 127.0f));
  }
  scale = amax / 127.0f;
  return q;
}

// y = (sum_b dot_b * scale_b) * scale_w + bias with each dot_b exact in
// int64: the kernel may differ by its float32 roundings, one per block of the
// sum and a few in the scaling.
::testing::AssertionResult matches_oracle(const HostTensor<float>& y, const HostTensor<float>& x,
                                          const Int8Weight& w, int64_t out,
                                          const std::optional<HostTensor<float>>& bias) {
  const int64_t rows = x.shape[0], in = x.shape[1];
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t n = 0; n < out; ++n) {
      double sum = 0.0, magnitude = 0.0;
      int64_t blocks = 0;
      for (int64_t begin = 0; begin < in; begin += kInt8KChunk, ++blocks) {
        const int64_t size = std::min(kInt8KChunk, in - begin);
        float sx = 0.0f;
        const std::vector<int32_t> qx = quantize(x.data.data() + m * in + begin, size, sx);
        int64_t dot = 0;
        for (int64_t k = 0; k < size; ++k) {
          dot += int64_t{qx[static_cast<size_t>(k)]} * w.q[static_cast<size_t>(n * in + begin + k)];
        }
        sum += static_cast<double>(dot) * sx;
        magnitude += std::abs(static_cast<double>(dot) * sx);
      }
      const double product = sum * w.scales[n];
      const double expected = product + (bias ? double{(*bias)[n]} : 0.0);
      const double bound = std::ldexp(magnitude * w.scales[n], -23) * static_cast<double>(blocks + 3) +
                           std::ldexp(std::abs(expected), -23) + 1e-30;
      const double got = y[m * out + n];
      if (!(std::abs(got - expected) <= bound)) {
        return ::testing::AssertionFailure() << "row " << m << " col " << n << ": got " << got << ", expected "
                                             << expected;
      }
    }
  }
  return ::testing::AssertionSuccess();
}

using Shape = std::tuple<int64_t, int64_t, int64_t>;  // rows, out, in
const Shape kShapes[] = {{1, 32, 64},   {3, 33, 7},    {1, 960, 576}, {12, 96, 576}, {17, 31, 130},
                         {16, 100, 1},  {130, 70, 96}, {0, 32, 8},    {25, 17, 100}, {2, 48, 1536}};

TEST(Int8Linear, MatchesFloat64LoopsOnEveryIsa) {
  std::mt19937 rng(11);
  testing::for_each_cpu_isa([&] {
    SCOPED_TRACE(std::string("kernel ") + std::string(int8_linear_kernel()));
    for (auto [rows, out, in] : kShapes) {
      for (bool with_bias : {false, true}) {
        SCOPED_TRACE("rows " + std::to_string(rows) + " out " + std::to_string(out) + " in " + std::to_string(in) +
                     (with_bias ? " bias" : ""));
        const HostTensor<float> x = random_tensor<float>({rows, in}, rng);
        const Int8Weight w = make_weight(out, in, rng);
        std::optional<HostTensor<float>> bias;
        std::optional<TensorView> bias_view;
        if (with_bias) {
          bias = random_tensor<float>({out}, rng);
          bias_view = bias->view();
        }
        HostTensor<float> y({rows, out});
        int8_linear(y.view(), x.view(), w.packed.view(), w.scales.view(), bias_view);
        EXPECT_TRUE(matches_oracle(y, x, w, out, bias));
      }
    }
  });
}

TEST(Int8Linear, ZeroRowsGiveTheBias) {
  std::mt19937 rng(2);
  const Int8Weight w = make_weight(20, 40, rng);
  const HostTensor<float> x({2, 40});  // all zero: amax 0
  const HostTensor<float> bias = random_tensor<float>({20}, rng);
  HostTensor<float> y({2, 20});
  int8_linear(y.view(), x.view(), w.packed.view(), w.scales.view(), bias.view());
  for (int64_t i = 0; i < 40; ++i) EXPECT_EQ(y.data[static_cast<size_t>(i)], bias[i % 20]);
}

TEST(Int8Linear, NamesItsKernel) {
  const CpuIsa before = cpu_isa();
  set_cpu_isa(CpuIsa::kBaseline);
  EXPECT_EQ(int8_linear_kernel(), "baseline_int32");
  set_cpu_isa(best_supported_cpu_isa());
  if (cpu_has_amx_int8()) {
    EXPECT_EQ(int8_linear_kernel(), "amx_int8 (avx512_vnni below 7 rows)");
  } else if (cpu_has_avx512_vnni()) {
    EXPECT_EQ(int8_linear_kernel(), "avx512_vnni");
  }
  set_cpu_isa(before);
}

TEST(Int8Linear, ThreadsAndBatchesAgreeBitForBit) {
  std::mt19937 rng(3);
  const HostTensor<float> x = random_tensor<float>({40, 576}, rng);
  const Int8Weight w = make_weight(1000, 576, rng);
  testing::for_each_cpu_isa([&] {
    HostTensor<float> threaded({40, 1000}), single({40, 1000});
    const int before = num_threads();
    set_num_threads(4);
    int8_linear(threaded.view(), x.view(), w.packed.view(), w.scales.view(), std::nullopt);
    set_num_threads(1);
    int8_linear(single.view(), x.view(), w.packed.view(), w.scales.view(), std::nullopt);
    set_num_threads(before);
    EXPECT_EQ(threaded.data, single.data);
    for (int64_t row : {0, 13, 39}) {
      HostTensor<float> x_row({1, 576}), y_row({1, 1000});
      std::copy(x.data.begin() + row * 576, x.data.begin() + (row + 1) * 576, x_row.data.begin());
      int8_linear(y_row.view(), x_row.view(), w.packed.view(), w.scales.view(), std::nullopt);
      EXPECT_TRUE(std::equal(y_row.data.begin(), y_row.data.end(), single.data.begin() + row * 1000)) << row;
    }
  });
}

TEST(Int8Linear, RejectsBadArguments) {
  std::mt19937 rng(5);
  const HostTensor<float> x = random_tensor<float>({4, 64}, rng);
  const Int8Weight w = make_weight(48, 64, rng);
  HostTensor<float> y({4, 48});
  const HostTensor<Half> x_half({4, 64});
  EXPECT_TRUE(throws_invalid(
      [&] { int8_linear(y.view(), x_half.view(), w.packed.view(), w.scales.view(), {}); },
      "int8_linear: x must be float32 or bfloat16"));
  const HostTensor<float> x_wrong_k = random_tensor<float>({4, 100}, rng);  // pads to 128, not 64
  EXPECT_TRUE(throws_invalid(
      [&] { int8_linear(y.view(), x_wrong_k.view(), w.packed.view(), w.scales.view(), {}); },
      "packed_weight"));
  const HostTensor<float> short_scales({47});
  EXPECT_TRUE(throws_invalid(
      [&] { int8_linear(y.view(), x.view(), w.packed.view(), short_scales.view(), {}); },
      "int8_linear: scales"));
  const HostTensor<int32_t> int_scales({48});
  EXPECT_TRUE(throws_invalid([&] { int8_linear(y.view(), x.view(), w.packed.view(), int_scales.view(), {}); },
                             "int8_linear: scales"));
}

}  // namespace
}  // namespace pagedserve::ops
