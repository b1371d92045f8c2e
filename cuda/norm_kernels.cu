// RMSNorm and fused residual-add + RMSNorm.
//
// Tiling: each row of H elements belongs to a group of `threads_per_row`
// threads (a power of two); a thread keeps its share of the row, at most
// kVecsPerThread 16-byte vectors, in registers, so every element is read once
// and written once. Groups of up to 32 threads reduce the sum of squares with
// warp shuffles; wider groups add one shared-memory step across their warps.
// A block is 256 threads (several rows) or one row's group when wider.
//
// Bytes per row: rms_norm reads and writes H elements; fused_add_rms_norm
// reads 2H (x, residual) and writes 2H. The weight stays in L1/L2. Both are
// bandwidth bound: at hidden 2048 bf16, 4096 rows move 32 MiB (fused).
//
// Rounding matches the CPU ops and HF's LlamaRMSNorm: the normalized value is
// rounded to the dtype before the weight multiply, and the fused variant
// normalizes the residual as stored (rounded), not the float sum.
//
// Where torch would reduce the row with its vectorized block reduction (rows
// of more than 128 elements, a multiple of 4; see TorchRowOrder), the mean of
// squares is summed in exactly torch's order (x.pow(2).mean(-1) on a [T, H]
// CUDA tensor) and finished as transformers does (* 1/H, rsqrt), so a bf16
// model normalizes bit for bit as transformers does on the same rows
// (bench/numerics/bf16_agreement.py). Other rows use the tree below.
#include <algorithm>

#include "cuda_check.h"
#include "cuda_ops.h"
#include "dependent_launch.cuh"
#include "dispatch.h"
#include "float_convert.cuh"
#include "launch_limits.h"
#include "ops/op_contracts.h"

namespace pagedserve::cuda {
namespace {

constexpr int kBlockThreads = 256;
constexpr int kMaxThreadsPerRow = 1024;

// Sum of v over the calling thread's row group. Every thread of the block
// must call it (it may hit a block barrier).
__device__ __forceinline__ float row_group_sum(float v, int threads_per_row, float* warp_sums) {
  const int width = min(threads_per_row, 32);
  for (int offset = width / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (threads_per_row <= 32) return v;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  if (threadIdx.x % 32 == 0) warp_sums[warp] = v;
  __syncthreads();
  const int warps_per_row = threads_per_row / 32;
  const int first_warp = warp / warps_per_row * warps_per_row;
  float total = 0.f;
  for (int w = 0; w < warps_per_row; ++w) total += warp_sums[first_warp + w];
  return total;
}

// kAddResidual: residual += in (stored rounded), then the norm of the new
// residual goes to out. Otherwise out = norm(in). out may alias in.
template <typename T, int kVec, int kVecsPerThread, bool kAddResidual>
__global__ void __launch_bounds__(kMaxThreadsPerRow)
    rms_norm_kernel(T* out, const T* in, T* residual, const T* weight, float eps, int rows, int hidden,
                    int threads_per_row) {
  __shared__ float warp_sums[kMaxThreadsPerRow / 32];
  const int rows_per_block = static_cast<int>(blockDim.x) / threads_per_row;
  const int group = static_cast<int>(threadIdx.x) / threads_per_row;
  const int lane = static_cast<int>(threadIdx.x) % threads_per_row;
  const int row = static_cast<int>(blockIdx.x) * rows_per_block + group;
  const bool row_valid = row < rows;  // no early return: the row sum may need a block barrier
  const int num_vecs = hidden / kVec;
  const int64_t row_offset = static_cast<int64_t>(row) * hidden;
  wait_for_previous_kernel();
  let_next_kernel_launch();

  float values[kVecsPerThread][kVec];
  float sum_sq = 0.f;
#pragma unroll
  for (int k = 0; k < kVecsPerThread; ++k) {
    const int v = lane + k * threads_per_row;
    if (!row_valid || v >= num_vecs) continue;
    const int64_t offset = row_offset + static_cast<int64_t>(v) * kVec;
    load_as_float(values[k], in + offset);
    if constexpr (kAddResidual) {
      float res[kVec];
      load_as_float(res, residual + offset);
#pragma unroll
      for (int e = 0; e < kVec; ++e) values[k][e] = round_through<T>(values[k][e] + res[e]);
      store_from_float(residual + offset, values[k]);
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) sum_sq += values[k][e] * values[k][e];
  }
  sum_sq = row_group_sum(sum_sq, threads_per_row, warp_sums);
  const float inv_rms = 1.f / sqrtf(sum_sq / static_cast<float>(hidden) + eps);

#pragma unroll
  for (int k = 0; k < kVecsPerThread; ++k) {
    const int v = lane + k * threads_per_row;
    if (!row_valid || v >= num_vecs) continue;
    float w[kVec];
    load_as_float(w, weight + static_cast<int64_t>(v) * kVec);
#pragma unroll
    for (int e = 0; e < kVec; ++e) values[k][e] = round_through<T>(values[k][e] * inv_rms) * w[e];
    store_from_float(out + row_offset + static_cast<int64_t>(v) * kVec, values[k]);
  }
}

// torch's ReduceConfig for a sum over the contiguous last dim of a [rows, hidden]
// float tensor (aten/src/ATen/native/cuda/Reduce.cuh, setReduceConfig and
// set_block_dimension, 512 threads at most): `width` threads share a row;
// thread t sums 4-wide vectors t, t + width, ... in four lane accumulators,
// adds them (((a0 + a1) + a2) + a3), then the threads fold pairwise: through
// shared memory while width > 32 (t += t + offset, offset = width / 2 .. 32),
// then by warp shuffles down with offsets 16, 8, 4, 2, 1 (measured on an H200
// with bench/numerics/norm_numerics.py: this order matches torch on every row).
struct TorchRowOrder {
  int width = 0;  // 0: torch would not take this path; use our own order
  float inv_hidden = 0.f;  // torch's mean factor: float(rows) / float(rows * hidden)

  static int last_pow2(int64_t n) {
    int p = 1;
    while (2 * static_cast<int64_t>(p) <= n) p *= 2;
    return p;
  }

  static TorchRowOrder of(int rows, int hidden) {
    constexpr int kMaxThreads = 512;
    TorchRowOrder order;
    if (hidden <= 128 || hidden % 4 != 0) return order;  // torch: no vectorized input
    const int64_t dim0 = hidden / 4;
    const int dim0_pow2 = dim0 < kMaxThreads ? last_pow2(dim0) : kMaxThreads;
    const int dim1_pow2 = rows < kMaxThreads ? last_pow2(rows) : kMaxThreads;
    int width = std::min(dim0_pow2, 32);
    const int height = std::min(dim1_pow2, kMaxThreads / width);
    width = std::min(dim0_pow2, kMaxThreads / height);
    const int values_per_thread = ceil_div(hidden, width);
    if (values_per_thread >= height * 16 || values_per_thread >= 256) return order;  // torch splits across warps
    order.width = width;
    order.inv_hidden = static_cast<float>(rows) / static_cast<float>(static_cast<int64_t>(rows) * hidden);
    return order;
  }
};

// One block per row, of at least max(width, 128) threads; squares staged in shared memory.
// Thread tid holds the row's 4-element vectors tid, tid + blockDim, ... (at most
// kIters of them) in registers: every load of x and the residual is issued
// before the first store, and the weights are loaded before the dependent-launch
// wait (dependent_launch.cuh: no dependent kernel writes them). The loop it
// replaces loaded, stored, then loaded again (the stores may alias the next
// loads, so each iteration waited on memory, the weights last). H200, TinyLlama
// shape: single stream 869.8 -> 934.6 tok/s (means of 8 paired runs); the 45
// norms of a batch-64 step 187-191 -> 173-175 us (bench/results/h200/session17.md).
template <typename T, bool kAddResidual, int kIters>
__global__ void __launch_bounds__(512)
    rms_norm_torch_order_kernel(T* out, const T* in, T* residual, const T* weight, float eps, int hidden,
                                int width, float inv_hidden) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  float* squares = reinterpret_cast<float*>(shared_bytes);  // [hidden], then [width] partial sums
  float* partial = squares + hidden;
  const int tid = static_cast<int>(threadIdx.x), stride = 4 * static_cast<int>(blockDim.x);
  const int64_t row_offset = static_cast<int64_t>(blockIdx.x) * hidden;
  float v[kIters][4], w[kIters][4];
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
    if (4 * tid + k * stride < hidden) load_as_float(w[k], weight + 4 * tid + k * stride);
  }
  wait_for_previous_kernel();
  let_next_kernel_launch();
  // 4 elements per vector (hidden % 4 == 0): every load first.
  float r[kIters][4];
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
    const int i = 4 * tid + k * stride;
    if (i >= hidden) continue;
    load_as_float(v[k], in + row_offset + i);
    if constexpr (kAddResidual) load_as_float(r[k], residual + row_offset + i);
  }
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
    const int i = 4 * tid + k * stride;
    if (i >= hidden) continue;
    if constexpr (kAddResidual) {
#pragma unroll
      for (int e = 0; e < 4; ++e) v[k][e] = round_through<T>(v[k][e] + r[k][e]);
      store_from_float(residual + row_offset + i, v[k]);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) squares[i + e] = __fmul_rn(v[k][e], v[k][e]);  // torch squares first: no FMA
  }
  __syncthreads();
  float sum = 0.f;
  if (tid < width) {
    float lanes[4] = {0.f, 0.f, 0.f, 0.f};
    for (int c = tid; 4 * c + 3 < hidden; c += width) {
#pragma unroll
      for (int i = 0; i < 4; ++i) lanes[i] = __fadd_rn(lanes[i], squares[4 * c + i]);
    }
    sum = __fadd_rn(__fadd_rn(__fadd_rn(lanes[0], lanes[1]), lanes[2]), lanes[3]);
    partial[tid] = sum;
  }
  for (int offset = width / 2; offset >= 32; offset /= 2) {
    __syncthreads();
    if (tid < offset) {
      sum = __fadd_rn(sum, partial[tid + offset]);
      partial[tid] = sum;
    }
  }
  if (tid < 32) {
    for (int offset = 16; offset > 0; offset /= 2) sum = __fadd_rn(sum, __shfl_down_sync(0xffffffffu, sum, offset));
    if (tid == 0) partial[0] = sum;
  }
  __syncthreads();
  const float inv_rms = rsqrtf(__fadd_rn(__fmul_rn(partial[0], inv_hidden), eps));
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
    const int i = 4 * tid + k * stride;
    if (i >= hidden) continue;
#pragma unroll
    for (int e = 0; e < 4; ++e) v[k][e] = round_through<T>(__fmul_rn(v[k][e], inv_rms)) * w[k][e];
    store_from_float(out + row_offset + i, v[k]);
  }
}

// Vectors a thread of rms_norm_torch_order_kernel holds, as compiled: 1, 2 or 4.
constexpr int kMaxNormIters = 4;
template <typename Fn>
void dispatch_norm_iters(int iters, Fn&& fn) {
  if (iters <= 1) return fn.template operator()<1>();
  if (iters <= 2) return fn.template operator()<2>();
  return fn.template operator()<4>();
}

int next_pow2(int n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

template <bool kAddResidual>
void launch_rms_norm(const char* op, void* out, const TensorView& in, void* residual, const TensorView& weight,
                     float eps, bool fixed_order, cudaStream_t stream) {
  const int rows = checked_int(op, "rows", in.size(0));
  const int hidden = checked_int(op, "hidden size", in.size(1));
  if (rows == 0 || hidden == 0) return;
  const TorchRowOrder order = TorchRowOrder::of(rows, hidden);
  const size_t order_smem = static_cast<size_t>(hidden + std::max(order.width, 1)) * sizeof(float);
  const bool aligned16 = is_aligned16(out) && is_aligned16(in.data) && is_aligned16(weight.data) &&
                         (residual == nullptr || is_aligned16(residual));  // the kernel loads 4-element vectors
  // The torch threads (width) sum the squares; every thread of the block loads: enough for kMaxNormIters
  // vectors a thread (torch's path has hidden < 8192: 512 threads suffice).
  const int order_threads =
      std::min(512, std::max({order.width, 128, next_pow2(ceil_div(hidden, 4 * kMaxNormIters))}));
  const int order_iters = ceil_div(hidden, 4 * order_threads);
  if (!fixed_order && order.width > 0 && order_smem <= 48 * 1024 && aligned16 && order_iters <= kMaxNormIters) {
    dispatch_float(in.dtype, op, [&]<typename T>() {
      dispatch_norm_iters(order_iters, [&]<int kIters>() {
        launch_dependent(rms_norm_torch_order_kernel<T, kAddResidual, kIters>, dim3(rows), dim3(order_threads),
                         order_smem, stream, kAddResidual ? "fused_add_rms_norm_kernel" : "rms_norm_kernel",
                         static_cast<T*>(out), in.ptr<const T>(), static_cast<T*>(residual), weight.ptr<const T>(),
                         eps, hidden, order.width, order.inv_hidden);
      });
    });
    return;
  }
  dispatch_float(in.dtype, op, [&]<typename T>() {
    const bool aligned = is_aligned16(out) && is_aligned16(in.data) && is_aligned16(weight.data) &&
                         (residual == nullptr || is_aligned16(residual));
    dispatch_vector_width<T>(aligned && hidden % kVec16<T> == 0, [&]<int kVec>() {
      const int num_vecs = hidden / kVec;
      PS_REQUIRE(num_vecs <= 4 * kMaxThreadsPerRow, op,
                   "hidden size " + std::to_string(hidden) + " is larger than the kernel supports");
      const bool one_per_thread = num_vecs <= kMaxThreadsPerRow;
      const int threads_per_row = next_pow2(one_per_thread ? num_vecs : ceil_div(num_vecs, 4));
      const int block = std::max(kBlockThreads, threads_per_row);
      const int grid = ceil_div(rows, block / threads_per_row);
      auto* typed_out = static_cast<T*>(out);
      const auto* typed_in = in.ptr<const T>();
      auto* typed_residual = static_cast<T*>(residual);
      const auto* typed_weight = weight.ptr<const T>();
      auto* kernel = one_per_thread ? rms_norm_kernel<T, kVec, 1, kAddResidual> : rms_norm_kernel<T, kVec, 4, kAddResidual>;
      launch_dependent(kernel, dim3(grid), dim3(block), 0, stream,
                       kAddResidual ? "fused_add_rms_norm_kernel" : "rms_norm_kernel", typed_out, typed_in,
                       typed_residual, typed_weight, eps, rows, hidden, threads_per_row);
    });
  });
}

}  // namespace

void rms_norm(const TensorView& out, const TensorView& x, const TensorView& weight, float eps, bool fixed_order,
              cudaStream_t stream) {
  constexpr const char* kOp = "rms_norm";
  ops::check_rms_norm(ops::Device::kCUDA, out, x, weight);
  DeviceGuard guard(x.device_index);
  launch_rms_norm<false>(kOp, out.data, x, nullptr, weight, eps, fixed_order, stream);
}

void fused_add_rms_norm(const TensorView& x, const TensorView& residual, const TensorView& weight, float eps,
                        bool fixed_order, cudaStream_t stream) {
  constexpr const char* kOp = "fused_add_rms_norm";
  ops::check_fused_add_rms_norm(ops::Device::kCUDA, x, residual, weight);
  DeviceGuard guard(x.device_index);
  launch_rms_norm<true>(kOp, x.data, x, residual.data, weight, eps, fixed_order, stream);
}

}  // namespace pagedserve::cuda
