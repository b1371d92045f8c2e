// Rotary position embeddings: the cos/sin table and its in-place application.
#include <cmath>
#include <numbers>
#include <string>
#include <vector>

#include "ops/cpu_isa.h"
#include "ops/dispatch.h"
#include "ops/float_types.h"
#include "ops/op_contracts.h"
#include "ops/ops.h"
#include "ops/parallel.h"

namespace pagedserve::ops {
namespace {

// The inverse frequencies in float32, step by step as HF transformers computes
// them (default rope, or _compute_llama3_parameters): the model was trained
// with these float32 values, not with their exact real counterparts.
float default_inverse_frequency(int64_t i, int64_t rotary_dim, double theta) {
  const float exponent = static_cast<float>(2 * i) / static_cast<float>(rotary_dim);
  return 1.0f / std::pow(static_cast<float>(theta), exponent);
}

// Llama 3.1: leave high frequencies alone, divide low ones by `factor`, and
// blend linearly (in wavelength ratio) in between.
float llama3_inverse_frequency(float inv_freq, const RopeScaling& s) {
  const auto factor = static_cast<float>(s.factor);
  const auto low_freq_factor = static_cast<float>(s.low_freq_factor);
  const auto old_context = static_cast<double>(s.original_max_position);
  const auto low_freq_wavelen = static_cast<float>(old_context / s.low_freq_factor);
  const auto high_freq_wavelen = static_cast<float>(old_context / s.high_freq_factor);

  const float wavelen = static_cast<float>(2.0 * std::numbers::pi) / inv_freq;
  if (wavelen < high_freq_wavelen) return inv_freq;
  if (wavelen > low_freq_wavelen) return inv_freq / factor;
  const float smooth = (static_cast<float>(old_context) / wavelen - low_freq_factor) /
                       static_cast<float>(s.high_freq_factor - s.low_freq_factor);
  return (1.0f - smooth) * inv_freq / factor + smooth * inv_freq;
}

void check_scaling(const RopeScaling& s) {
  constexpr std::string_view op = "rope_cos_sin_cache";
  if (s.factor <= 0.0) return;
  PS_REQUIRE(s.low_freq_factor > 0.0, op, "scaling.low_freq_factor must be > 0");
  PS_REQUIRE(s.high_freq_factor > s.low_freq_factor, op, "scaling.high_freq_factor must be > scaling.low_freq_factor");
  PS_REQUIRE(s.original_max_position > 0, op, "scaling.original_max_position must be > 0");
}

// x1 = x[:half], x2 = x[half:2 half], rotated in place by the angles whose
// cosines and sines are cos[:half], sin[:half].
// Rounds like HF's apply_rotary_pos_emb in the model dtype: cos and sin are
// rounded to T, and each product and the sum are rounded to T (identity for
// float32), so a reduced-precision model rotates exactly as transformers does.
template <typename T>
PS_ALWAYS_INLINE void rotate_head(T* x, const float* cos, const float* sin, int64_t half) {
  T* x2 = x + half;
  for (int64_t i = 0; i < half; ++i) {
    const float a = to_float(x[i]);
    const float b = to_float(x2[i]);
    const float c = round_to<T>(cos[i]);
    const float s = round_to<T>(sin[i]);
    x[i] = from_float<T>(round_to<T>(a * c) - round_to<T>(b * s));
    x2[i] = from_float<T>(round_to<T>(b * c) + round_to<T>(a * s));
  }
}

}  // namespace

void rope_cos_sin_cache(const TensorView& cos_sin, double theta, const RopeScaling& scaling) {
  constexpr std::string_view op = "rope_cos_sin_cache";
  require_tensor_of(op, "cos_sin", cos_sin, Device::kCPU, 2, DType::kFloat32);
  const int64_t rotary_dim = cos_sin.size(1);
  PS_REQUIRE(rotary_dim > 0 && rotary_dim % 2 == 0, op, "rotary dim must be even and > 0, got " + cos_sin.describe());
  PS_REQUIRE(theta > 0.0, op, "theta must be > 0, got " + std::to_string(theta));
  check_scaling(scaling);

  const int64_t half = rotary_dim / 2;
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    const float f = default_inverse_frequency(i, rotary_dim, theta);
    inv_freq[static_cast<size_t>(i)] = scaling.factor > 0.0 ? llama3_inverse_frequency(f, scaling) : f;
  }
  const int64_t max_position = cos_sin.size(0);
  parallel_for_range(max_position, 16 * rotary_dim, [&](int64_t begin, int64_t end) {
    for (int64_t pos = begin; pos < end; ++pos) {
      float* row = cos_sin.ptr<float>() + pos * rotary_dim;
      for (int64_t i = 0; i < half; ++i) {
        // The angle is rounded to float32 as HF's does; cos/sin of it are then exact.
        const float angle = static_cast<float>(pos) * inv_freq[static_cast<size_t>(i)];
        row[i] = static_cast<float>(std::cos(static_cast<double>(angle)));
        row[half + i] = static_cast<float>(std::sin(static_cast<double>(angle)));
      }
    }
  });
}

void rotary_embedding(const TensorView& positions, const TensorView& query, const TensorView& key,
                      const TensorView& cos_sin) {
  check_rotary_embedding(Device::kCPU, positions, query, key, cos_sin);
  const int64_t tokens = positions.size(0);
  const int64_t q_heads = query.size(1);
  const int64_t kv_heads = key.size(1);
  const int64_t head_dim = query.size(2);
  const int64_t rotary_dim = cos_sin.size(1);
  const int64_t half = rotary_dim / 2;
  dispatch_float(query.dtype, "rotary_embedding", [&]<typename T>() {
    parallel_for_range(tokens, (q_heads + kv_heads) * rotary_dim, [&](int64_t begin, int64_t end) {
      with_cpu_isa([&]() PS_INLINE_BODY {
        for (int64_t t = begin; t < end; ++t) {
          const float* cos = cos_sin.ptr<float>() + positions.ptr<int32_t>()[t] * rotary_dim;
          const float* sin = cos + half;
          T* q = query.ptr<T>() + t * q_heads * head_dim;
          for (int64_t h = 0; h < q_heads; ++h) rotate_head(q + h * head_dim, cos, sin, half);
          T* k = key.ptr<T>() + t * kv_heads * head_dim;
          for (int64_t h = 0; h < kv_heads; ++h) rotate_head(k + h * head_dim, cos, sin, half);
        }
      });
    });
  });
}

}  // namespace pagedserve::ops
