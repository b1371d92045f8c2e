// Gumbel noise from a counter-based hash, identical on the host and the GPU.
//
// sample_tokens (ops.h) picks argmax_v(logits[v] / T + g(key, v)): with g
// standard Gumbel noise this samples softmax(logits / T) exactly (the
// Gumbel-max trick), in one read of the logits. The noise of element v of a
// row is a pure function of (row key, v), so the CPU op and the CUDA kernel
// draw the same numbers, and no generator state has to live on the device.
#pragma once

#include <cmath>
#include <cstdint>

#include "hash_mix.h"

namespace pagedserve::ops {

using pagedserve::mix64;

// The key of row `row` for a step drawn with `seed`.
PS_HOST_DEVICE uint64_t gumbel_row_key(uint64_t seed, int64_t row) {
  return mix64(seed ^ mix64(static_cast<uint64_t>(row) + 0x632be59bd9b4e019ULL));
}

// The 32 random bits of element `index`'s noise.
PS_HOST_DEVICE uint32_t noise_bits(uint64_t key, int64_t index) {
  return static_cast<uint32_t>(mix64(key + static_cast<uint64_t>(index) * 0x9e3779b97f4a7c15ULL) >> 32);
}

// The noise of 32 random bits h: g = -log(-log(u)) for the uniform u = 1 - v, v = (2^32 - 1 - h + 0.5) / 2^32,
// so g grows with h. -log(u) is computed as -log1p(-v): where g is large, u is within 2^-24 of 1 and not
// representable apart from 1, but v is (to float's relative precision), so the tail keeps its mass: the
// noise exceeds 20 for 2.1e-9 of the h, as a Gumbel does. (A uniform of 24 bits, (k + 0.5) / 2^24, put
// all of the tail past 16.6 into one value, which rounded to u = 1: infinite noise, one token in 2^24
// drawn whatever its probability.) v stays below 1 where h = 0 rounds up. The logarithms are glibc's on
// the host and CUDA's on the GPU; the GPU tests check the two sample alike.
PS_HOST_DEVICE float gumbel_noise(uint32_t bits) {
  const float v = fminf((static_cast<float>(~bits) + 0.5f) * 0x1p-32f, 0x1.fffffep-1f);
  return -logf(-log1pf(-v));
}

// Above the largest noise: g(2^32 - 1) = -log(2^-33) = 22.87, with room for rounding. A token whose
// logit / T plus this cannot reach the best score so far cannot win.
inline constexpr float kMaxGumbel = 23.0f;

// Upper bounds on the noise by bucket of the 32 bits, for skipping candidates that cannot win (the CUDA
// kernel keeps them in shared memory). The top 8 bits make 255 coarse buckets (the noise moves 0.011
// across one at u = 0.5, 0.4 at u = 0.99); the last 1/256 of the range (u > 255/256, where the noise
// climbs from 5.5 to 22.9) splits on the next 8 bits into 256 fine buckets.
inline constexpr int kCoarseNoiseBuckets = 255;
inline constexpr int kNoiseBuckets = kCoarseNoiseBuckets + 256;
// Added to a bucket's largest noise: covers the logarithms' 1-ulp errors (~2e-6 at these magnitudes), so
// the bound stays above every noise in the bucket on either side whatever the rounding.
inline constexpr float kNoiseBoundMargin = 1e-3f;

PS_HOST_DEVICE int noise_bucket(uint32_t bits) {
  const int coarse = static_cast<int>(bits >> 24);
  return coarse < kCoarseNoiseBuckets ? coarse : kCoarseNoiseBuckets + static_cast<int>((bits >> 16) & 255u);
}

// The largest 32-bit value in bucket b (the noise grows with the bits).
PS_HOST_DEVICE uint32_t noise_bucket_last_bits(int b) {
  if (b < kCoarseNoiseBuckets) return (static_cast<uint32_t>(b + 1) << 24) - 1u;
  const auto fine = static_cast<uint32_t>(b - kCoarseNoiseBuckets);
  return (static_cast<uint32_t>(kCoarseNoiseBuckets) << 24) + ((fine + 1) << 16) - 1u;
}

// At least the noise of every 32-bit value in bucket b.
PS_HOST_DEVICE float noise_bucket_bound(int b) {
  return gumbel_noise(noise_bucket_last_bits(b)) + kNoiseBoundMargin;
}

}  // namespace pagedserve::ops
