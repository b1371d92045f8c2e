// Matrix products of a few rows: out = x W^T (+ bias) for M <= kMaxSmallBatchRows
// rows of x, the decode steps of one to eight sequences.
//
// Why not cuBLAS: at M = 1 a product only streams W once, so it is bound by
// memory, and the library's kernels reach 45-70 % of the copy bandwidth on
// TinyLlama's projections (H200: qkv 10.5 MB in 5.7 us, down 23 MB in 8.8 us
// plus a split-K reduce kernel), and the gated MLP needs a second kernel for
// silu(gate) * up. Here one warp owns one output column (one row of W, two for
// the gated epilogue; small_batch_dot.cuh). No shared memory, no split-K, one
// launch.
//
// Arithmetic: float32 products and sums; each output is rounded once to the
// dtype after the bias is added, as cuBLAS rounds its float32 accumulator.
// The gated epilogue rounds gate and up to the dtype first (the values the
// unfused path would store), then computes round(silu(gate)) * up, exactly as
// silu_and_mul does (activation_kernel.cu). The summation order depends only
// on K, never on M or N: a row's result is the same in any batch this kernel
// serves.
#include <algorithm>

#include "cuda_check.h"
#include "cuda_ops.h"
#include "dependent_launch.cuh"
#include "dispatch.h"
#include "float_convert.cuh"
#include "launch_limits.h"
#include "ops/op_contracts.h"
#include "small_batch_dot.cuh"

namespace pagedserve::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
using small_batch::kLanes;

__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

// The output of one column: bias added, then (gated) round(silu(gate)) * up with both rounded first.
template <typename T, bool kGated>
__device__ __forceinline__ float epilogue(float value, float up, const T* bias, int n, int num_cols) {
  if (bias != nullptr) {
    value += to_float(bias[n]);
    if constexpr (kGated) up += to_float(bias[num_cols + n]);
  }
  if constexpr (kGated) {
    const float gate = round_through<T>(value);
    value = round_through<T>(silu(gate)) * round_through<T>(up);
  }
  return value;
}

// One warp per output column n of out [kRows, num_cols]. kGated: W = [gate; up]
// with num_cols rows each, out = round(silu(gate)) * up. Launched dependent
// (dependent_launch.cuh). Loading the first weights before the wait, into
// registers or as an L2 bulk prefetch, measured slower than waiting first
// (bench/perf/small_batch_linear_bench.py on an H200: the registers cost
// occupancy, the prefetch doubles the first round's traffic).
template <typename T, int kRows, bool kGated>
__global__ void __launch_bounds__(kWarpsPerBlock* kLanes)
    small_batch_linear_kernel(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight,
                              const T* __restrict__ bias, int k_size, int num_cols) {
  const int lane = static_cast<int>(threadIdx.x) % kLanes;
  const int n = static_cast<int>(blockIdx.x) * kWarpsPerBlock + static_cast<int>(threadIdx.x) / kLanes;
  wait_for_previous_kernel();  // x comes from the kernel before
  let_next_kernel_launch();
  if (n >= num_cols) return;  // whole warps leave together: the shuffles below stay full-warp
  const T* row = weight + static_cast<int64_t>(n) * k_size;
  float acc[kRows] = {}, up_acc[kRows] = {};
  small_batch::warp_dot<T, kRows, kGated>(acc, up_acc, row, row + static_cast<int64_t>(num_cols) * k_size, x, k_size,
                                          lane);
  if (lane < kRows) {
    const float value = epilogue<T, kGated>(small_batch::row_of_lane(acc, lane), small_batch::row_of_lane(up_acc, lane),
                                            bias, n, num_cols);
    out[static_cast<int64_t>(lane) * num_cols + n] = from_float<T>(value);
  }
}

template <typename T, bool kGated>
void launch(const TensorView& out, const TensorView& x, const TensorView& weight, const TensorView& bias,
            int num_cols, cudaStream_t stream) {
  const int rows = static_cast<int>(x.size(0));
  const int k_size = checked_int("small_batch_linear", "K", x.size(1));
  const int grid = ceil_div(num_cols, kWarpsPerBlock);
  const T* bias_ptr = bias.data == nullptr ? nullptr : bias.ptr<const T>();
  dispatch_small_rows(rows, "small_batch_linear", [&]<int kRows>() {
    launch_dependent(small_batch_linear_kernel<T, kRows, kGated>, dim3(grid), dim3(kWarpsPerBlock * kLanes), 0,
                     stream, "small_batch_linear_kernel", out.ptr<T>(), x.ptr<const T>(), weight.ptr<const T>(),
                     bias_ptr, k_size, num_cols);
  });
}

}  // namespace

void small_batch_linear(const TensorView& out, const TensorView& x, const TensorView& weight, const TensorView& bias,
                        bool gated, cudaStream_t stream) {
  constexpr const char* kOp = "small_batch_linear";
  ops::check_small_batch_linear(ops::Device::kCUDA, out, x, weight, bias, gated);
  if (out.numel() == 0) return;
  const int num_cols = checked_int(kOp, "output columns", out.size(1));
  DeviceGuard guard(x.device_index);
  dispatch_float(x.dtype, kOp, [&]<typename T>() {
    small_batch::require_vector_operands<T>(kOp, x, weight);
    if (gated) {
      launch<T, true>(out, x, weight, bias, num_cols, stream);
    } else {
      launch<T, false>(out, x, weight, bias, num_cols, stream);
    }
  });
}

}  // namespace pagedserve::cuda
