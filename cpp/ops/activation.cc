// Gated activations of the MLP.
#include "ops/cpu_isa.h"
#include "ops/dispatch.h"
#include "ops/float_types.h"
#include "ops/op_contracts.h"
#include "ops/ops.h"
#include "ops/parallel.h"
#include "ops/vec_math.h"

namespace pagedserve::ops {
namespace {

// silu(gate) is rounded to T before the product, as torch computes
// F.silu(gate) * up in the model dtype (HF's LlamaMLP).
template <typename T>
PS_ALWAYS_INLINE void silu_and_mul_row(T* out, const T* gate, const T* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = from_float<T>(round_to<T>(silu(to_float(gate[i]))) * to_float(up[i]));
}

}  // namespace

void silu_and_mul(const TensorView& out, const TensorView& x) {
  constexpr std::string_view op = "silu_and_mul";
  check_silu_and_mul(Device::kCPU, out, x);
  const int64_t rows = x.size(0);
  const int64_t width = x.size(1) / 2;
  dispatch_float(x.dtype, op, [&]<typename T>() {
    parallel_for_range(rows, 3 * width, [&](int64_t begin, int64_t end) {
      with_cpu_isa([&]() PS_INLINE_BODY {
        for (int64_t row = begin; row < end; ++row) {
          const T* gate = x.ptr<T>() + row * 2 * width;
          silu_and_mul_row(out.ptr<T>() + row * width, gate, gate + width, width);
        }
      });
    });
  });
}

}  // namespace pagedserve::ops
