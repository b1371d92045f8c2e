// Gumbel noise from a counter-based hash, identical on the host and the GPU.
//
// sample_tokens (ops.h) picks argmax_v(logits[v] / T + g(key, v)): with g
// standard Gumbel noise this samples softmax(logits / T) exactly (the
// Gumbel-max trick), in one read of the logits. The noise of element v of a
// row is a pure function of (row key, v), so the CPU op and the CUDA kernel
// draw the same numbers, and no generator state has to live on the device.
#pragma once

#include <cstdint>

#include "hash_mix.h"

namespace pagedserve::ops {

using pagedserve::mix64;

// The key of row `row` for a step drawn with `seed`.
PS_HOST_DEVICE uint64_t gumbel_row_key(uint64_t seed, int64_t row) {
  return mix64(seed ^ mix64(static_cast<uint64_t>(row) + 0x632be59bd9b4e019ULL));
}

// A uniform in (0, 1) with 24 random bits: (k + 0.5) / 2^24, exact in float32.
PS_HOST_DEVICE float uniform_open(uint64_t key, int64_t index) {
  const uint64_t bits = mix64(key + static_cast<uint64_t>(index) * 0x9e3779b97f4a7c15ULL) >> 40;
  return (static_cast<float>(bits) + 0.5f) * (1.0f / 16777216.0f);
}

}  // namespace pagedserve::ops
