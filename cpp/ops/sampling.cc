// sample_tokens: Gumbel-max sampling, one pass over each row's logits.
#include <cmath>
#include <limits>

#include "ops/dispatch.h"
#include "ops/float_types.h"
#include "ops/gumbel_noise.h"
#include "ops/op_contracts.h"
#include "ops/ops.h"
#include "ops/parallel.h"
#include "ops/token_mask.h"

namespace pagedserve::ops {
namespace {

// Token v's logit, or -inf where `allowed` (one row of the bitmask, or null) clears its bit.
template <typename T>
float masked_logit(const T* logits, const int32_t* allowed, int64_t v) {
  return token_allowed(allowed, v) ? to_float(logits[v]) : -std::numeric_limits<float>::infinity();
}

template <typename T>
int32_t sample_row(const T* logits, const int32_t* allowed, int64_t vocab, float inv_temperature, uint64_t key) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_id = 0;
  for (int64_t v = 0; v < vocab; ++v) {  // the argmax: the answer for greedy rows, a head start otherwise
    const float x = masked_logit(logits, allowed, v);
    if (x > best) {
      best = x;
      best_id = v;
    }
  }
  if (inv_temperature <= 0.0f) return static_cast<int32_t>(best_id);
  // The argmax's own score is a lower bound on the winner's, and no noise
  // exceeds kMaxGumbel, so ids scoring below best - kMaxGumbel before noise
  // cannot win: skipping their two logarithms changes nothing (most of a
  // vocabulary sits that far below its top logits).
  const float gumbel_at_max = gumbel_noise(noise_bits(key, best_id));
  best = std::fma(best, inv_temperature, gumbel_at_max);
  const float cutoff = best - kMaxGumbel;
  for (int64_t v = 0; v < vocab; ++v) {
    const float x = masked_logit(logits, allowed, v);
    const float scaled = x * inv_temperature;
    if (scaled < cutoff || v == best_id) continue;
    const float gumbel = gumbel_noise(noise_bits(key, v));
    // One fused multiply-add, as the CUDA kernel does, so both round alike.
    const float score = std::fma(x, inv_temperature, gumbel);
    if (score > best || (score == best && v < best_id)) {
      best = score;
      best_id = v;
    }
  }
  return static_cast<int32_t>(best_id);
}

}  // namespace

void sample_tokens(const TensorView& out, const TensorView& logits, const TensorView& inv_temperature,
                   const TensorView& allowed, uint64_t seed) {
  constexpr std::string_view op = "sample_tokens";
  check_sample_tokens(Device::kCPU, out, logits, inv_temperature, allowed);
  const int64_t rows = logits.size(0), vocab = logits.size(1), words = token_mask_words(vocab);
  const float* inv_t = inv_temperature.ptr<const float>();
  const int32_t* mask = allowed.data == nullptr ? nullptr : allowed.ptr<const int32_t>();
  int32_t* ids = out.ptr<int32_t>();
  dispatch_float(logits.dtype, op, [&]<typename T>() {
    const T* base = logits.ptr<const T>();
    parallel_run(rows * vocab).for_each(rows, [&](int64_t r, int) {
      ids[r] = sample_row(base + r * vocab, mask == nullptr ? nullptr : mask + r * words, vocab, inv_t[r],
                          gumbel_row_key(seed, r));
    });
  });
}

}  // namespace pagedserve::ops
