// Matrix products of a few rows: out = x W^T (+ bias) for M <= kMaxSmallBatchRows
// rows of x, the decode steps of one to eight sequences.
//
// Why not cuBLAS: at M = 1 a product only streams W once, so it is bound by
// memory, and the library's kernels reach 45-70 % of the copy bandwidth on
// TinyLlama's projections (H200: qkv 10.5 MB in 5.7 us, down 23 MB in 8.8 us
// plus a split-K reduce kernel), and the gated MLP needs a second kernel for
// silu(gate) * up. Here one warp owns one output column (one row of W, two for
// the gated epilogue): each lane streams 16-byte pieces of the row, so a
// warp's loads cover 512 contiguous bytes per step, dots them with every row
// of x (a few KiB, served from L1), and the warp sums its lanes with a fixed
// shuffle tree. No shared memory, no split-K, one launch.
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
#include "dispatch.h"
#include "float_convert.cuh"
#include "launch_limits.h"
#include "ops/op_contracts.h"

namespace pagedserve::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kLanes = 32;

__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

// acc[m] += dot(w[k0, k0 + V), x[m][k0, k0 + V)) for one lane's piece.
template <typename T, int kRows, int kVec>
__device__ __forceinline__ void dot_piece(float (&acc)[kRows], const float (&w)[kVec], const T* x, int k0,
                                          int k_size) {
#pragma unroll
  for (int m = 0; m < kRows; ++m) {
    float xv[kVec];
    load_as_float(xv, x + m * k_size + k0);
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[m] = __fmaf_rn(w[e], xv[e], acc[m]);
  }
}

template <int kRows>
__device__ __forceinline__ void warp_sum(float (&acc)[kRows]) {
#pragma unroll
  for (int m = 0; m < kRows; ++m) {
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset /= 2) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], offset);
  }
}

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
// with num_cols rows each, out = round(silu(gate)) * up.
template <typename T, int kRows, bool kGated>
__global__ void __launch_bounds__(kWarpsPerBlock* kLanes)
    small_batch_linear_kernel(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight,
                              const T* __restrict__ bias, int k_size, int num_cols) {
  constexpr int kVec = kVec16<T>;
  const int lane = static_cast<int>(threadIdx.x) % kLanes;
  const int n = static_cast<int>(blockIdx.x) * kWarpsPerBlock + static_cast<int>(threadIdx.x) / kLanes;
  if (n >= num_cols) return;  // whole warps leave together: the shuffles below stay full-warp
  const T* row = weight + static_cast<int64_t>(n) * k_size;
  const T* up_row = row + static_cast<int64_t>(num_cols) * k_size;
  float acc[kRows] = {}, up_acc[kRows] = {};
  // Eight pieces in flight per lane keep the loads ahead of memory latency (K = 2048 is 8 pieces: the
  // whole row at once). ptxas (CUDA 13, sm_90) spilled a few bytes at unroll 1, 2 and 4 in some of the
  // 48 instantiations, none at 8 (at most 146 registers, 8 gated rows).
#pragma unroll 8
  for (int k0 = lane * kVec; k0 < k_size; k0 += kLanes * kVec) {
    float w[kVec];
    load_as_float(w, row + k0);
    dot_piece<T, kRows, kVec>(acc, w, x, k0, k_size);
    if constexpr (kGated) {
      float u[kVec];
      load_as_float(u, up_row + k0);
      dot_piece<T, kRows, kVec>(up_acc, u, x, k0, k_size);
    }
  }
  warp_sum(acc);
  if constexpr (kGated) warp_sum(up_acc);
  // Lane m writes row m (a compile-time index per branch: registers cannot be indexed at run time).
#pragma unroll
  for (int m = 0; m < kRows; ++m) {
    if (m == lane) out[static_cast<int64_t>(m) * num_cols + n] = from_float<T>(epilogue<T, kGated>(acc[m], up_acc[m], bias, n, num_cols));
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
    small_batch_linear_kernel<T, kRows, kGated><<<grid, kWarpsPerBlock * kLanes, 0, stream>>>(
        out.ptr<T>(), x.ptr<const T>(), weight.ptr<const T>(), bias_ptr, k_size, num_cols);
    check_launch("small_batch_linear_kernel");
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
    PS_REQUIRE(x.size(1) % kVec16<T> == 0 && is_aligned16(x.data) && is_aligned16(weight.data), kOp,
               "x and weight need K a multiple of " + std::to_string(kVec16<T>) + " and 16-byte alignment, got " +
                   x.describe() + " and " + weight.describe());
    if (gated) {
      launch<T, true>(out, x, weight, bias, num_cols, stream);
    } else {
      launch<T, false>(out, x, weight, bias, num_cols, stream);
    }
  });
}

}  // namespace pagedserve::cuda
