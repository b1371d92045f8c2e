// RMSNorm, plain and fused with the residual add.
//
// Rounding follows HF transformers' LlamaRMSNorm so a reduced-precision model
// matches it bit for bit: the normalized value is rounded to the model dtype
// before the weight multiply, and the fused variant normalizes the residual
// as stored (rounded), not the float sum.
#include <cmath>

#include "ops/cpu_isa.h"
#include "ops/dispatch.h"
#include "ops/float_types.h"
#include "ops/op_contracts.h"
#include "ops/ops.h"
#include "ops/parallel.h"
#include "ops/vec_math.h"

namespace pagedserve::ops {
namespace {

template <typename T>
PS_ALWAYS_INLINE float sum_of_squares(const T* x, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const float v = to_float(x[i + k]);
      lanes[k] += v * v;
    }
  }
  for (; i < n; ++i) {
    const float v = to_float(x[i]);
    lanes[0] += v * v;
  }
  return sum_lanes(lanes);
}

PS_ALWAYS_INLINE float inverse_rms(float sum_of_squares, int64_t n, float eps) {
  return 1.0f / std::sqrt(sum_of_squares / static_cast<float>(n) + eps);
}

// out may alias x: each element is read before it is written.
template <typename T>
PS_ALWAYS_INLINE void normalize_row(T* out, const T* x, const T* weight, int64_t n, float inv_rms) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = from_float<T>(round_to<T>(to_float(x[i]) * inv_rms) * to_float(weight[i]));
  }
}

// residual += x, stored in T; returns the sum of squares of the stored values.
// Two passes over one row (it stays in L1): a store and a reduction in one
// loop would not vectorize.
template <typename T>
PS_ALWAYS_INLINE float add_residual_row(T* residual, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) residual[i] = from_float<T>(to_float(residual[i]) + to_float(x[i]));
  return sum_of_squares(residual, n);
}

template <typename T>
PS_ALWAYS_INLINE void rms_norm_rows(T* out, const T* x, const T* weight, int64_t begin, int64_t end, int64_t hidden,
                                    float eps) {
  for (int64_t row = begin; row < end; ++row) {
    const T* x_row = x + row * hidden;
    const float inv_rms = inverse_rms(sum_of_squares(x_row, hidden), hidden, eps);
    normalize_row(out + row * hidden, x_row, weight, hidden, inv_rms);
  }
}

template <typename T>
PS_ALWAYS_INLINE void fused_add_rms_norm_rows(T* x, T* residual, const T* weight, int64_t begin, int64_t end,
                                              int64_t hidden, float eps) {
  for (int64_t row = begin; row < end; ++row) {
    T* x_row = x + row * hidden;
    T* residual_row = residual + row * hidden;
    const float inv_rms = inverse_rms(add_residual_row(residual_row, x_row, hidden), hidden, eps);
    normalize_row(x_row, residual_row, weight, hidden, inv_rms);
  }
}

}  // namespace

void rms_norm(const TensorView& out, const TensorView& x, const TensorView& weight, float eps) {
  check_rms_norm(Device::kCPU, out, x, weight);
  const int64_t rows = x.size(0);
  const int64_t hidden = x.size(1);
  dispatch_float(x.dtype, "rms_norm", [&]<typename T>() {
    parallel_for_range(rows, hidden, [&](int64_t begin, int64_t end) {
      with_cpu_isa([&]() PS_INLINE_BODY {
        rms_norm_rows(out.ptr<T>(), x.ptr<T>(), weight.ptr<T>(), begin, end, hidden, eps);
      });
    });
  });
}

void fused_add_rms_norm(const TensorView& x, const TensorView& residual, const TensorView& weight, float eps) {
  check_fused_add_rms_norm(Device::kCPU, x, residual, weight);
  const int64_t rows = x.size(0);
  const int64_t hidden = x.size(1);
  dispatch_float(x.dtype, "fused_add_rms_norm", [&]<typename T>() {
    parallel_for_range(rows, 2 * hidden, [&](int64_t begin, int64_t end) {
      with_cpu_isa([&]() PS_INLINE_BODY {
        fused_add_rms_norm_rows(x.ptr<T>(), residual.ptr<T>(), weight.ptr<T>(), begin, end, hidden, eps);
      });
    });
  });
}

}  // namespace pagedserve::ops
