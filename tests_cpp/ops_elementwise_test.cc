// rms_norm, fused_add_rms_norm, silu_and_mul, rope_cos_sin_cache and
// rotary_embedding against float64 loops written here.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "ops/ops.h"
#include "ops_test_util.h"

namespace pagedserve::ops {
namespace {

using testing::HostTensor;
using testing::all_close;
using testing::as_double;
using testing::random_tensor;
using testing::throws_invalid;

template <typename T>
class ElementwiseTest : public ::testing::Test {
 protected:
  std::mt19937 rng_{20240601};
};
TYPED_TEST_SUITE(ElementwiseTest, testing::FloatTypes);

std::vector<double> rms_norm_oracle(const std::vector<double>& x, const std::vector<double>& w, int64_t rows,
                                    int64_t hidden, double eps) {
  std::vector<double> out(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    const auto at = [&](int64_t i) { return static_cast<size_t>(r * hidden + i); };
    double sum = 0;
    for (int64_t i = 0; i < hidden; ++i) sum += x[at(i)] * x[at(i)];
    const double inv = 1.0 / std::sqrt(sum / static_cast<double>(hidden) + eps);
    for (int64_t i = 0; i < hidden; ++i) out[at(i)] = x[at(i)] * inv * w[static_cast<size_t>(i)];
  }
  return out;
}

template <typename T>
std::vector<double> to_doubles(const HostTensor<T>& t) {
  std::vector<double> v;
  for (const T& x : t.data) v.push_back(as_double(x));
  return v;
}

TYPED_TEST(ElementwiseTest, RmsNorm) {
  using T = TypeParam;
  testing::for_each_cpu_isa([&] {
    for (auto [rows, hidden] : {std::pair<int64_t, int64_t>{1, 576}, {7, 67}, {300, 576}, {3, 5}}) {
      auto x = random_tensor<T>({rows, hidden}, this->rng_, 3.0f);
      auto w = random_tensor<T>({hidden}, this->rng_);
      auto out = testing::full_tensor<T>({rows, hidden}, NAN);
      rms_norm(out.view(), x.view(), w.view(), 1e-5f);
      // Two roundings to T: the normalized value, then the product with the weight.
      EXPECT_TRUE(all_close(out, rms_norm_oracle(to_doubles(x), to_doubles(w), rows, hidden, 1e-5), 2.0))
          << rows << "x" << hidden;
    }
  });
}

TYPED_TEST(ElementwiseTest, RmsNormInPlace) {
  using T = TypeParam;
  testing::for_each_cpu_isa([&] {
    auto x = random_tensor<T>({4, 100}, this->rng_);
    auto w = random_tensor<T>({100}, this->rng_);
    const auto expected = rms_norm_oracle(to_doubles(x), to_doubles(w), 4, 100, 1e-6);
    rms_norm(x.view(), x.view(), w.view(), 1e-6f);
    EXPECT_TRUE(all_close(x, expected, 2.0));
  });
}

TYPED_TEST(ElementwiseTest, FusedAddRmsNorm) {
  using T = TypeParam;
  testing::for_each_cpu_isa([&] {
    for (auto [rows, hidden] : {std::pair<int64_t, int64_t>{1, 576}, {9, 33}, {260, 576}}) {
      auto x = random_tensor<T>({rows, hidden}, this->rng_);
      auto residual = random_tensor<T>({rows, hidden}, this->rng_, 4.0f);
      auto w = random_tensor<T>({hidden}, this->rng_);
      std::vector<double> sum = to_doubles(x);
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += as_double(residual.data[i]);
      fused_add_rms_norm(x.view(), residual.view(), w.view(), 1e-5f);
      EXPECT_TRUE(all_close(residual, sum));
      // The norm reads the residual as stored in T.
      EXPECT_TRUE(all_close(x, rms_norm_oracle(to_doubles(residual), to_doubles(w), rows, hidden, 1e-5), 2.0));
    }
  });
}

TYPED_TEST(ElementwiseTest, SiluAndMul) {
  using T = TypeParam;
  testing::for_each_cpu_isa([&] {
    for (auto [rows, width] : {std::pair<int64_t, int64_t>{1, 1536}, {13, 37}, {64, 1536}}) {
      auto x = random_tensor<T>({rows, 2 * width}, this->rng_, 4.0f);
      auto out = testing::full_tensor<T>({rows, width}, NAN);
      silu_and_mul(out.view(), x.view());
      std::vector<double> expected;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < width; ++i) {
          const double g = as_double(x[r * 2 * width + i]);
          expected.push_back(g / (1.0 + std::exp(-g)) * as_double(x[r * 2 * width + width + i]));
        }
      }
      EXPECT_TRUE(all_close(out, expected, 2.0)) << rows << "x" << width;
    }
  });
}

// ---------------------------------------------------------------------------
// Rotary

double llama3_frequency_oracle(double inv_freq, const RopeScaling& s) {
  const double wavelen = 2 * std::numbers::pi / inv_freq;
  const double low_wavelen = static_cast<double>(s.original_max_position) / s.low_freq_factor;
  const double high_wavelen = static_cast<double>(s.original_max_position) / s.high_freq_factor;
  if (wavelen < high_wavelen) return inv_freq;
  if (wavelen > low_wavelen) return inv_freq / s.factor;
  const double smooth = (static_cast<double>(s.original_max_position) / wavelen - s.low_freq_factor) /
                        (s.high_freq_factor - s.low_freq_factor);
  return (1 - smooth) * inv_freq / s.factor + smooth * inv_freq;
}

void expect_table_matches(const HostTensor<float>& table, double theta, const RopeScaling& scaling) {
  const int64_t positions = table.shape[0];
  const int64_t rotary_dim = table.shape[1];
  const int64_t half = rotary_dim / 2;
  for (int64_t p = 0; p < positions; ++p) {
    for (int64_t i = 0; i < half; ++i) {
      double f = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(rotary_dim));
      if (scaling.factor > 0) f = llama3_frequency_oracle(f, scaling);
      // The table follows HF's float32 steps (frequency, then angle): allow their rounding.
      const double tolerance = 2e-6 + static_cast<double>(p) * f * 4e-7;
      ASSERT_NEAR(table[p * rotary_dim + i], std::cos(static_cast<double>(p) * f), tolerance) << p << "," << i;
      ASSERT_NEAR(table[p * rotary_dim + half + i], std::sin(static_cast<double>(p) * f), tolerance) << p << "," << i;
    }
  }
}

TEST(RopeCache, DefaultMatchesFormula) {
  HostTensor<float> table({3000, 64});
  rope_cos_sin_cache(table.view(), 10000.0, RopeScaling{});
  expect_table_matches(table, 10000.0, RopeScaling{});
  HostTensor<float> partial({100, 32});
  rope_cos_sin_cache(partial.view(), 1e6, RopeScaling{});
  expect_table_matches(partial, 1e6, RopeScaling{});
}

TEST(RopeCache, Llama3ScalingMatchesFormula) {
  const RopeScaling scaling{8.0, 1.0, 4.0, 8192};
  HostTensor<float> table({2000, 128});
  rope_cos_sin_cache(table.view(), 500000.0, scaling);
  expect_table_matches(table, 500000.0, scaling);
  // All three regimes occur for these parameters: check one frequency of each directly.
  HostTensor<float> plain({2, 128});
  rope_cos_sin_cache(plain.view(), 500000.0, RopeScaling{});
  // Position 1's sines are sin(f_i), close to f_i for the slow rotations.
  const float* plain_sin = &plain[128 + 64];
  const float* scaled_sin = &table[128 + 64];
  EXPECT_EQ(scaled_sin[0], plain_sin[0]);                          // high frequency: unchanged
  EXPECT_NEAR(scaled_sin[63], plain_sin[63] / 8, 1e-6 * plain_sin[63]);  // low frequency: divided by factor
}

TEST(RopeCache, RejectsBadArguments) {
  HostTensor<float> odd({4, 7});
  EXPECT_TRUE(throws_invalid([&] { rope_cos_sin_cache(odd.view(), 1e4, {}); }, "rotary dim must be even"));
  HostTensor<float> table({4, 8});
  EXPECT_TRUE(throws_invalid([&] { rope_cos_sin_cache(table.view(), -1.0, {}); }, "theta must be > 0"));
  EXPECT_TRUE(throws_invalid([&] { rope_cos_sin_cache(table.view(), 1e4, RopeScaling{8.0, 4.0, 4.0, 8192}); },
                             "high_freq_factor must be > scaling.low_freq_factor"));
  HostTensor<BFloat16> wrong_dtype({4, 8});
  EXPECT_TRUE(throws_invalid([&] { rope_cos_sin_cache(wrong_dtype.view(), 1e4, {}); }, "cos_sin must be float32"));
}

template <typename T>
void rotary_oracle_check(const HostTensor<T>& before, const HostTensor<T>& after, const HostTensor<int32_t>& positions,
                         const HostTensor<float>& table) {
  const int64_t tokens = before.shape[0], heads = before.shape[1], head_dim = before.shape[2];
  const int64_t half = table.shape[1] / 2;
  std::vector<double> expected(before.data.size());
  for (int64_t t = 0; t < tokens; ++t) {
    const float* cos = table.data.data() + positions[t] * table.shape[1];
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t base = (t * heads + h) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) expected[static_cast<size_t>(base + d)] = as_double(before[base + d]);
      for (int64_t i = 0; i < half; ++i) {
        // HF's apply_rotary_pos_emb in the model dtype: cos, sin and each product rounded to T.
        const auto r = [](double v) { return as_double(from_float<T>(static_cast<float>(v))); };
        const double x1 = as_double(before[base + i]), x2 = as_double(before[base + half + i]);
        const double c = r(cos[i]), s = r(cos[half + i]);
        expected[static_cast<size_t>(base + i)] = r(x1 * c) - r(x2 * s);
        expected[static_cast<size_t>(base + half + i)] = r(x2 * c) + r(x1 * s);
      }
      for (int64_t d = 2 * half; d < head_dim; ++d) {
        ASSERT_EQ(as_double(after[base + d]), as_double(before[base + d])) << "dims past the rotary dim changed";
      }
    }
  }
  EXPECT_TRUE(all_close(after, expected));
}

TYPED_TEST(ElementwiseTest, RotaryEmbedding) {
  using T = TypeParam;
  testing::for_each_cpu_isa([&] {
    for (auto [head_dim, rotary_dim] : {std::pair<int64_t, int64_t>{64, 64}, {128, 128}, {64, 32}, {80, 40}}) {
      const int64_t tokens = 11, q_heads = 9, kv_heads = 3, max_position = 600;
      HostTensor<float> table({max_position, rotary_dim});
      rope_cos_sin_cache(table.view(), 10000.0, RopeScaling{});
      HostTensor<int32_t> positions({tokens});
      std::uniform_int_distribution<int32_t> any_position(0, max_position - 1);
      for (auto& p : positions.data) p = any_position(this->rng_);
      positions[0] = max_position - 1;
      auto query = random_tensor<T>({tokens, q_heads, head_dim}, this->rng_);
      auto key = random_tensor<T>({tokens, kv_heads, head_dim}, this->rng_);
      const auto query_before = query, key_before = key;
      rotary_embedding(positions.view(), query.view(), key.view(), table.view());
      rotary_oracle_check(query_before, query, positions, table);
      rotary_oracle_check(key_before, key, positions, table);
    }
  });
}

TEST(RotaryEmbedding, RejectsBadArguments) {
  HostTensor<float> table({16, 64});
  rope_cos_sin_cache(table.view(), 10000.0, RopeScaling{});
  HostTensor<float> query({2, 4, 64}), key({2, 2, 64});
  auto positions = testing::int_tensor({2}, {0, 16});
  EXPECT_TRUE(throws_invalid([&] { rotary_embedding(positions.view(), query.view(), key.view(), table.view()); },
                             "positions[1] = 16 is outside the cos_sin_cache [0, 16)"));
  positions[1] = -1;
  EXPECT_TRUE(throws_invalid([&] { rotary_embedding(positions.view(), query.view(), key.view(), table.view()); },
                             "positions[1] = -1"));
  positions[1] = 3;
  HostTensor<float> narrow({2, 4, 32});
  EXPECT_TRUE(throws_invalid([&] { rotary_embedding(positions.view(), narrow.view(), narrow.view(), table.view()); },
                             "rotary dim must be even and in (0, head_dim = 32]"));
  HostTensor<Half> half_key({2, 2, 64});
  EXPECT_TRUE(throws_invalid([&] { rotary_embedding(positions.view(), query.view(), half_key.view(), table.view()); },
                             "key must have the same dtype"));
  HostTensor<float> short_key({1, 2, 64});
  EXPECT_TRUE(throws_invalid([&] { rotary_embedding(positions.view(), query.view(), short_key.view(), table.view()); },
                             "key must have size 2 in dim 0"));
}

TEST(NormAndActivation, RejectBadArguments) {
  HostTensor<float> x({4, 8}), w({8}), out({4, 8});
  HostTensor<float> short_w({7});
  EXPECT_TRUE(throws_invalid([&] { rms_norm(out.view(), x.view(), short_w.view(), 1e-5f); },
                             "rms_norm: weight must have size 8 in dim 0"));
  HostTensor<BFloat16> bf_out({4, 8});
  EXPECT_TRUE(throws_invalid([&] { rms_norm(bf_out.view(), x.view(), w.view(), 1e-5f); },
                             "rms_norm: out must have the same dtype"));
  TensorView transposed = x.view();
  transposed.strides = {1, 4};
  EXPECT_TRUE(throws_invalid([&] { rms_norm(out.view(), transposed, w.view(), 1e-5f); }, "x must be contiguous"));
  HostTensor<int32_t> ints({4, 8});
  EXPECT_TRUE(throws_invalid([&] { fused_add_rms_norm(ints.view(), x.view(), w.view(), 1e-5f); },
                             "fused_add_rms_norm: x must be float32, float16 or bfloat16"));
  TensorView on_gpu = x.view();
  on_gpu.device = Device::kCUDA;
  EXPECT_TRUE(throws_invalid([&] { silu_and_mul(out.view(), on_gpu); }, "silu_and_mul: x must be on the cpu"));
  HostTensor<float> odd({4, 7});
  EXPECT_TRUE(throws_invalid([&] { silu_and_mul(out.view(), odd.view()); }, "x's last dim must be even"));
  EXPECT_TRUE(
      throws_invalid([&] { silu_and_mul(out.view(), x.view()); }, "silu_and_mul: out must have size 4 in dim 1"));
}

}  // namespace
}  // namespace pagedserve::ops
