// sample_tokens against plain loops: greedy rows are the argmax, and the
// Gumbel-max draws follow softmax(logits / T).
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <vector>

#include "ops/cpu_isa.h"
#include "ops/float_types.h"
#include "ops/gumbel_noise.h"
#include "ops/ops.h"
#include "ops_test_util.h"

namespace pagedserve::ops {
namespace {

using testing::HostTensor;

// Draws `rows` samples of the same logits row under `seed`.
std::vector<int32_t> draw(const std::vector<float>& row, int rows, float temperature, uint64_t seed) {
  const auto vocab = static_cast<int64_t>(row.size());
  HostTensor<float> logits({rows, vocab});
  for (int r = 0; r < rows; ++r) std::copy(row.begin(), row.end(), logits.data.begin() + r * vocab);
  HostTensor<float> inv_t({rows});
  std::fill(inv_t.data.begin(), inv_t.data.end(), temperature > 0 ? 1.0f / temperature : 0.0f);
  HostTensor<int32_t> out({rows});
  sample_tokens(out.view(), logits.view(), inv_t.view(), {}, seed);
  return out.data;
}

TEST(SampleTokens, GreedyRowsTakeTheArgmaxLowestIdOnTies) {
  const std::vector<float> row = {0.5f, 3.0f, -1.0f, 3.0f, 2.9f};
  for (int32_t id : draw(row, 7, 0.0f, 42)) EXPECT_EQ(id, 1);
}

TEST(SampleTokens, FollowsTheSoftmaxDistribution) {
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f, -1.0f, 0.5f};
  const float temperature = 0.7f;
  std::vector<double> p(logits.size());
  double z = 0;
  for (size_t v = 0; v < p.size(); ++v) z += p[v] = std::exp(logits[v] / temperature);
  std::vector<int> counts(logits.size(), 0);
  const int rows = 1000, seeds = 60;
  for (uint64_t seed = 1; seed <= seeds; ++seed) {
    for (int32_t id : draw(logits, rows, temperature, seed)) ++counts[static_cast<size_t>(id)];
  }
  const double n = rows * seeds;
  for (size_t v = 0; v < p.size(); ++v) {
    const double expected = n * p[v] / z;
    const double sigma = std::sqrt(expected * (1 - p[v] / z));
    EXPECT_NEAR(counts[v], expected, 5 * sigma) << "token " << v;  // 5 sigma: a false alarm every ~2 million runs
  }
}

TEST(SampleTokens, SameSeedSameDrawsOtherSeedOtherDraws) {
  std::vector<float> row(1000);
  std::iota(row.begin(), row.end(), 0.0f);
  for (float& x : row) x = std::sin(x) * 2.0f;
  const auto a = draw(row, 64, 1.0f, 7), b = draw(row, 64, 1.0f, 7), c = draw(row, 64, 1.0f, 8);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_NE(std::vector<int32_t>(a.begin(), a.begin() + 32), std::vector<int32_t>(a.begin() + 32, a.end()))
      << "rows of one step draw independent noise";
}

TEST(SampleTokens, ReducedPrecisionLogitsSampleLikeTheirFloatValues) {
  HostTensor<BFloat16> logits({16, 300});
  HostTensor<float> as_float({16, 300});
  for (int64_t i = 0; i < logits.numel(); ++i) {
    logits[i] = float_to_bf16(std::cos(static_cast<float>(i)) * 3.0f);
    as_float[i] = bf16_to_float(logits[i]);
  }
  HostTensor<float> inv_t({16});
  for (int r = 0; r < 16; ++r) inv_t[r] = r % 3 == 0 ? 0.0f : 1.3f;
  HostTensor<int32_t> got({16}), want({16});
  sample_tokens(got.view(), logits.view(), inv_t.view(), {}, 99);
  sample_tokens(want.view(), as_float.view(), inv_t.view(), {}, 99);
  EXPECT_EQ(got.data, want.data);
}

TEST(SampleTokens, RejectsBadArguments) {
  HostTensor<float> logits({2, 5});
  HostTensor<float> inv_t({2});
  HostTensor<int32_t> out({3});
  EXPECT_TRUE(testing::throws_invalid([&] { sample_tokens(out.view(), logits.view(), inv_t.view(), {}, 1); },
                                      "sample_tokens: out must have size 2"));
  HostTensor<int32_t> ok({2});
  HostTensor<int32_t> int_logits({2, 5});
  EXPECT_TRUE(testing::throws_invalid([&] { sample_tokens(ok.view(), int_logits.view(), inv_t.view(), {}, 1); },
                                      "sample_tokens: logits"));
}

TEST(SampleTokens, AnAllowedMaskSamplesAsMinusInfinityLogitsDo) {
  // Rows of 77 tokens (three mask words, the last one partly used): every row masked differently, one
  // row with nothing allowed (token 0, as all -inf logits give), greedy and temperature rows.
  const int rows = 24, vocab = 77, words = 3;
  HostTensor<float> logits({rows, vocab}), minus_inf({rows, vocab});
  HostTensor<int32_t> allowed({rows, words});
  uint32_t state = 12345;
  auto next = [&] { return state = state * 1664525u + 1013904223u; };
  for (int r = 0; r < rows; ++r) {
    for (int w = 0; w < words; ++w) allowed[r * words + w] = r == 5 ? 0 : static_cast<int32_t>(next() & next());
    for (int v = 0; v < vocab; ++v) {
      logits[r * vocab + v] = std::sin(static_cast<float>(r * vocab + v)) * 4.0f;
      const bool ok = (static_cast<uint32_t>(allowed[r * words + v / 32]) >> (v % 32)) & 1u;
      minus_inf[r * vocab + v] = ok ? logits[r * vocab + v] : -INFINITY;
    }
  }
  HostTensor<float> inv_t({rows});
  for (int r = 0; r < rows; ++r) inv_t[r] = r % 4 == 0 ? 0.0f : 0.8f;
  HostTensor<int32_t> got({rows}), want({rows});
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    sample_tokens(got.view(), logits.view(), inv_t.view(), allowed.view(), seed);
    sample_tokens(want.view(), minus_inf.view(), inv_t.view(), {}, seed);
    ASSERT_EQ(got.data, want.data) << "seed " << seed;
    for (int r = 0; r < rows; ++r) {
      const int32_t id = got[r];
      EXPECT_TRUE(r == 5 ? id == 0 : ((static_cast<uint32_t>(allowed[r * words + id / 32]) >> (id % 32)) & 1u))
          << "row " << r << " drew a token its mask forbids";
    }
  }
  HostTensor<int32_t> short_mask({rows, 2});
  EXPECT_TRUE(testing::throws_invalid(
      [&] { sample_tokens(got.view(), logits.view(), inv_t.view(), short_mask.view(), 1); },
      "sample_tokens: allowed must have size 3"));
}

// The plain definition: every token scored, the highest wins, the lowest id on ties; -inf everywhere gives 0.
template <typename T>
int32_t every_token_scored(const T* row, const int32_t* allowed, int64_t vocab, float inv_t, uint64_t key) {
  float best = -INFINITY;
  int32_t best_id = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    const bool ok = allowed == nullptr || ((static_cast<uint32_t>(allowed[v / 32]) >> (v % 32)) & 1u);
    const float x = ok ? to_float(row[v]) : -INFINITY;
    const float score = inv_t > 0 ? std::fma(x, inv_t, gumbel_noise(noise_bits(key, v))) : x;
    if (score > best) {
      best = score;
      best_id = static_cast<int32_t>(v);
    }
  }
  return best_id;
}

// The op skips the tokens that cannot win (with 16-token vector tests at AVX-512 and above): at every ISA
// level this CPU has, every row draws what scoring every token draws. Rows: flat (random-weight logits: the
// noise decides), peaked, equal, two +inf, NaN, masked, two tokens allowed, nothing allowed; vocabularies
// with a tail past the last 16 tokens.
template <typename T>
void expect_every_level_scores_as_every_token(int64_t vocab) {
  const int rows = 48;
  const int64_t words = (vocab + 31) / 32;
  HostTensor<T> logits({rows, vocab});
  HostTensor<float> inv_t({rows});
  HostTensor<int32_t> allowed({rows, words});
  uint64_t state = 99;
  auto next = [&] { return state = state * 6364136223846793005ULL + 1442695040888963407ULL; };
  auto uniform = [&] { return static_cast<float>(next() >> 40) / 16777216.0f; };
  const float spreads[] = {0.6f, 4.0f, 30.0f, 0.0f};
  const float temperatures[] = {0.6f, 1.0f, 0.0f, 0.001f, 5.0f};
  for (int r = 0; r < rows; ++r) {
    for (int64_t v = 0; v < vocab; ++v) {
      const float gaussian = std::sqrt(-2 * std::log(uniform() + 1e-7f)) * std::cos(6.2831853f * uniform());
      logits[r * vocab + v] = ops::from_float<T>(spreads[r % 4] * gaussian);
    }
    if (r % 6 == 4) logits[r * vocab + vocab / 3] = logits[r * vocab + vocab / 2] = ops::from_float<T>(INFINITY);
    if (r % 6 == 5) logits[r * vocab + vocab / 5] = ops::from_float<T>(NAN);
    const float t = temperatures[r % 5];
    inv_t[r] = t > 0 ? 1 / t : 0;
    for (int64_t w = 0; w < words; ++w) {
      allowed[r * words + w] = r % 8 == 3 ? 0 : r % 8 == 7 ? 0 : static_cast<int32_t>(next() >> 32);
    }
    if (r % 8 == 7) {  // two tokens
      for (const int64_t v : {int64_t(next() % vocab), int64_t(next() % vocab)}) {
        allowed[r * words + v / 32] |= 1 << (v % 32);
      }
    }
  }
  const CpuIsa before = cpu_isa();
  for (const CpuIsa level : supported_cpu_isas()) {
    set_cpu_isa(level);
    for (const bool masked : {false, true}) {
      for (const uint64_t seed : {1ULL, 0xfeedULL}) {
        HostTensor<int32_t> got({rows});
        sample_tokens(got.view(), logits.view(), inv_t.view(), masked ? allowed.view() : TensorView{}, seed);
        for (int r = 0; r < rows; ++r) {
          const int32_t want = every_token_scored(&logits[r * vocab], masked ? &allowed[r * words] : nullptr, vocab,
                                                  inv_t[r], gumbel_row_key(seed, r));
          EXPECT_EQ(got[r], want) << cpu_isa_name(level) << " vocab " << vocab << " row " << r << " seed " << seed
                                  << (masked ? " masked" : "");
        }
      }
    }
  }
  set_cpu_isa(before);
}

TEST(SampleTokens, EveryIsaLevelDrawsWhatScoringEveryTokenDraws) {
  expect_every_level_scores_as_every_token<float>(4099);
  expect_every_level_scores_as_every_token<BFloat16>(1037);
  expect_every_level_scores_as_every_token<Half>(2048);
}

// The noise of the 32 bits h is a Gumbel variable: the share of h whose noise exceeds g is 1 - exp(-e^-g),
// out to the far tail (where a 24-bit uniform rounded to 1 and gave infinite noise), and it is finite and
// at most kMaxGumbel everywhere. The share is found by bisection: the noise grows with h.
TEST(GumbelNoise, FollowsTheGumbelTailAndStaysFinite) {
  for (const double g : {-2.0, 0.0, 2.0, 5.0, 10.0, 15.0, 20.0, 22.0}) {
    uint64_t lo = 0, hi = uint64_t(1) << 32;  // the first h whose noise exceeds g is in [lo, hi]
    while (lo < hi) {
      const uint64_t mid = (lo + hi) / 2;
      if (gumbel_noise(static_cast<uint32_t>(mid)) > g) hi = mid; else lo = mid + 1;
    }
    const double count = std::ldexp(1.0, 32) - double(lo), expected = -std::expm1(-std::exp(-g)) * std::ldexp(1.0, 32);
    EXPECT_LE(std::abs(count - expected), std::max(2.0, 1e-4 * expected)) << "noise above " << g;
  }
  for (const uint32_t h : {0u, 1u, 0x80000000u, 0xfffffffeu, 0xffffffffu}) {
    EXPECT_TRUE(std::isfinite(gumbel_noise(h))) << h;
    EXPECT_LE(gumbel_noise(h), kMaxGumbel) << h;
  }
  EXPECT_GT(gumbel_noise(0xffffffffu), 22.8f);
}

// The CUDA kernel skips a candidate when its logit / T plus its noise bucket's bound stays below the best so
// far: the noise of every h in a bucket must be at most the bucket's bound (checked at both ends of every
// bucket, at 2,048 points inside each, and at every h of the steep top 2^20), and the buckets tile the bits in
// order. The bound must not be so loose that nothing is skipped: within 0.02 of the noise at u = 0.5.
TEST(GumbelNoise, EveryNoiseIsAtMostItsBucketsBound) {
  int64_t above = 0;
  uint32_t first = 0;
  uint64_t state = 12345;
  for (int b = 0; b < kNoiseBuckets; ++b) {
    const uint32_t last = noise_bucket_last_bits(b);
    const float bound = noise_bucket_bound(b);
    ASSERT_EQ(noise_bucket(first), b);
    ASSERT_EQ(noise_bucket(last), b);
    above += gumbel_noise(first) > bound || gumbel_noise(last) > bound;
    for (int i = 0; i < 2048; ++i) {
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      const auto h = static_cast<uint32_t>(first + (state >> 33) % (uint64_t(last) - first + 1));
      above += gumbel_noise(h) > bound;
    }
    first = last + 1;
  }
  EXPECT_EQ(first, 0u);  // the last bucket ends at 2^32 - 1
  for (uint32_t h = 0xfff00000u; h != 0; ++h) above += gumbel_noise(h) > noise_bucket_bound(noise_bucket(h));
  EXPECT_EQ(above, 0);
  EXPECT_LT(noise_bucket_bound(128) - gumbel_noise(0x80000000u), 0.02f);
}

}  // namespace
}  // namespace pagedserve::ops
