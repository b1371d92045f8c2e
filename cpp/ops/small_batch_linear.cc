// small_batch_linear on the CPU: the reference for the CUDA kernel
// (cuda/small_batch_linear.cu), a plain loop, not a fast path (CPU models run
// their products through the packed kernels).
//
// Float32 products summed in k order per output, bias added, one rounding to
// the dtype; gated: gate and up rounded, then round(silu(gate)) * up with an
// exact exp, as the CUDA kernel and silu_and_mul compute it.
#include <cmath>

#include "ops/dispatch.h"
#include "ops/float_types.h"
#include "ops/op_contracts.h"
#include "ops/ops.h"
#include "ops/parallel.h"

namespace pagedserve::ops {
namespace {

template <typename T>
float dot_row(const T* x, const T* w, int64_t k_size) {
  float acc = 0.0f;
  for (int64_t k = 0; k < k_size; ++k) acc = std::fma(to_float(w[k]), to_float(x[k]), acc);
  return acc;
}

}  // namespace

void small_batch_linear(const TensorView& out, const TensorView& x, const TensorView& weight, const TensorView& bias,
                        bool gated) {
  check_small_batch_linear(Device::kCPU, out, x, weight, bias, gated);
  const int64_t rows = x.size(0), k_size = x.size(1), cols = out.size(1);
  dispatch_float(x.dtype, "small_batch_linear", [&]<typename T>() {
    const T* b = bias.data == nullptr ? nullptr : bias.ptr<const T>();
    parallel_for_range(cols, rows * k_size * (gated ? 2 : 1), [&](int64_t begin, int64_t end) {
      for (int64_t m = 0; m < rows; ++m) {
        const T* xm = x.ptr<const T>() + m * k_size;
        for (int64_t n = begin; n < end; ++n) {
          float value = dot_row(xm, weight.ptr<const T>() + n * k_size, k_size) + (b ? to_float(b[n]) : 0.0f);
          if (gated) {
            const float up = dot_row(xm, weight.ptr<const T>() + (cols + n) * k_size, k_size) +
                             (b ? to_float(b[cols + n]) : 0.0f);
            const float gate = round_to<T>(value);
            value = round_to<T>(gate / (1.0f + std::exp(-gate))) * round_to<T>(up);
          }
          out.ptr<T>()[m * cols + n] = from_float<T>(value);
        }
      }
    });
  });
}

}  // namespace pagedserve::ops
