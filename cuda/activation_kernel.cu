// SwiGLU activation: out = silu(gate) * up with x = [gate | up] per row.
//
// Tiling: a grid-stride loop over the T * I/kVec output vectors; each thread
// loads one 16-byte vector of gate and one of up, writes one of out.
// silu(gate) is rounded to the dtype before the product, as HF's LlamaMLP
// computes F.silu(gate) * up in the model dtype (and so do the CPU ops).
// Bytes: reads 2 * T * I elements, writes T * I (at TinyLlama's I = 5632,
// bf16, one 4096-token prefill moves 138 MiB).
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
constexpr int kMaxBlocks = 65536;  // beyond this the grid-stride loop takes over

__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

template <typename T, int kVec>
__global__ void __launch_bounds__(kBlockThreads)
    silu_and_mul_kernel(T* out, const T* x, int64_t num_vecs, int vecs_per_row, int intermediate) {
  wait_for_previous_kernel();  // launched dependent: x comes from the kernel before
  let_next_kernel_launch();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < num_vecs; v += stride) {
    const int64_t row = v / vecs_per_row;
    const int col = static_cast<int>(v % vecs_per_row) * kVec;
    const T* gate_ptr = x + row * 2 * intermediate + col;
    float gate[kVec], up[kVec], result[kVec];
    load_as_float(gate, gate_ptr);
    load_as_float(up, gate_ptr + intermediate);
#pragma unroll
    for (int e = 0; e < kVec; ++e) result[e] = round_through<T>(silu(gate[e])) * up[e];
    store_from_float(out + row * intermediate + col, result);
  }
}

}  // namespace

void silu_and_mul(const TensorView& out, const TensorView& x, cudaStream_t stream) {
  constexpr const char* kOp = "silu_and_mul";
  ops::check_silu_and_mul(ops::Device::kCUDA, out, x);
  const int intermediate = checked_int(kOp, "intermediate size", out.size(1));
  if (out.numel() == 0) return;
  DeviceGuard guard(x.device_index);
  dispatch_float(x.dtype, kOp, [&]<typename T>() {
    const bool vectorized = intermediate % kVec16<T> == 0 && is_aligned16(out.data) && is_aligned16(x.data);
    dispatch_vector_width<T>(vectorized, [&]<int kVec>() {
      const int vecs_per_row = intermediate / kVec;
      const int64_t num_vecs = out.size(0) * vecs_per_row;
      const auto grid = static_cast<int>(std::min<int64_t>(ceil_div(num_vecs, int64_t{kBlockThreads}), kMaxBlocks));
      launch_dependent(silu_and_mul_kernel<T, kVec>, dim3(grid), dim3(kBlockThreads), 0, stream, "silu_and_mul_kernel",
                       out.ptr<T>(), x.ptr<const T>(), num_vecs, vecs_per_row, intermediate);
    });
  });
}

}  // namespace pagedserve::cuda
