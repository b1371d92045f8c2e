// grouped_linear: mixture-of-experts products, rows grouped by expert
// (layout: cpp/ops/grouped_linear.h; semantics: ops::grouped_linear).
//
// float16 / bfloat16, grouped_mma_kernel: a CTA computes a 64 x 64 tile of
// out (64 of one expert's rows x 64 output columns) on mma.m16n8k16 tensor
// cores, 4 warps x 16 rows. K streams in chunks of 64 through a 2-stage
// cp.async pipeline: the x rows and the expert's weight rows land in swizzled
// tiles (smem_tile.cuh), which is the shape of attention's S = Q K^T (x as the
// queries, W_e as the keys), so the fragments load as in warp_scores. The
// weight tile is W_e's rows [n0, n0 + 64) as stored, i.e. the "col" B operand.
//
// The routing stays on the device: grid.y counts row tiles over all experts,
// an upper bound of ceil(R / 64) + E, and each CTA walks expert_offsets to find
// its expert and row tile (CTAs past the last tile exit). So the launch needs
// only host shapes and is safe to capture in a CUDA graph. Offsets past the
// R rows (a caller error the GPU cannot report) are clamped to R: no read or
// write leaves x or out.
//
// float32, grouped_f32_kernel: one thread per output element, float32 dot
// products in K order (a reference-grade path, like attention's).
#include <cstdint>
#include <type_traits>

#include "cuda_check.h"
#include "cuda_ops.h"
#include "dispatch.h"
#include "float_convert.cuh"
#include "launch_limits.h"
#include "mma.cuh"
#include "ops/op_contracts.h"
#include "smem_tile.cuh"

namespace pagedserve::cuda {
namespace grouped {

constexpr const char* kOp = "grouped_linear";
inline constexpr int kWarps = 4;
inline constexpr int kThreads = kWarps * 32;
inline constexpr int kTileRows = kWarps * 16;  // mma M per warp
inline constexpr int kTileCols = 64;
inline constexpr int kChunk = 64;  // K per stage: one swizzled tile row
inline constexpr int kStages = 2;
inline constexpr int kF32Threads = 128;
using Tile = SwizzledTile<kChunk>;

template <typename T>
struct SharedLayout {
  static constexpr int kTileElems = kTileRows * kChunk;  // kTileCols == kTileRows: one size for both
  static constexpr int kStageBytes = 2 * kTileElems * static_cast<int>(sizeof(T));
  static constexpr int kBytes = kStages * kStageBytes;
};

// The expert and first row of row tile `tile` (over all experts), or false past the last.
__device__ __forceinline__ bool find_row_tile(const int32_t* offsets, int num_experts, int tile, int& expert,
                                              int& row_begin, int& row_end) {
  for (int e = 0; e < num_experts; ++e) {
    const int begin = offsets[e];
    const int end = offsets[e + 1];
    const int tiles = end > begin ? (end - begin + kTileRows - 1) / kTileRows : 0;
    if (tile < tiles) {
      expert = e;
      row_begin = begin + tile * kTileRows;
      row_end = min(end, row_begin + kTileRows);
      return true;
    }
    tile -= tiles;
  }
  return false;
}

// Rows [0, num_rows) of src (row stride k_size) at columns [k0, k0 + 64) into a
// swizzled tile; rows past num_rows and columns past k_size are zero-filled.
template <typename T>
__device__ __forceinline__ void load_tile_async(T* tile, const T* src, int num_rows, int k_size, int k0, int tid) {
  constexpr int kChunks = kTileRows * Tile::kChunksPerRow;
#pragma unroll
  for (int k = 0; k < kChunks / kThreads; ++k) {
    const int i = tid + k * kThreads;
    const int row = i / Tile::kChunksPerRow;
    const int chunk = i % Tile::kChunksPerRow;
    const int col = k0 + chunk * 8;
    const bool valid = row < num_rows && col < k_size;
    const T* from = valid ? src + static_cast<int64_t>(row) * k_size + col : src;
    cp_async_16(tile + Tile::offset(row, chunk), from, valid);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) grouped_mma_kernel(T* out, const T* x, const T* weight,
                                                               const int32_t* offsets, int num_experts, int num_rows,
                                                               int n_size, int k_size) {
  using Layout = SharedLayout<T>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* stages = reinterpret_cast<T*>(shared_bytes);
  int expert = 0, row_begin = 0, row_end = 0;
  if (!find_row_tile(offsets, num_experts, static_cast<int>(blockIdx.y), expert, row_begin, row_end)) return;
  row_end = min(row_end, num_rows);
  if (row_begin < 0 || row_begin >= row_end) return;
  const int n0 = static_cast<int>(blockIdx.x) * kTileCols;
  const int tid = static_cast<int>(threadIdx.x);
  const T* x_rows = x + static_cast<int64_t>(row_begin) * k_size;
  const T* w_rows = weight + (static_cast<int64_t>(expert) * n_size + n0) * k_size;
  auto x_tile = [&](int chunk) { return stages + chunk % kStages * 2 * Layout::kTileElems; };
  auto w_tile = [&](int chunk) { return x_tile(chunk) + Layout::kTileElems; };
  auto load_chunk = [&](int chunk) {
    load_tile_async<T>(x_tile(chunk), x_rows, row_end - row_begin, k_size, chunk * kChunk, tid);
    load_tile_async<T>(w_tile(chunk), w_rows, min(kTileCols, n_size - n0), k_size, chunk * kChunk, tid);
  };
  const int num_chunks = (k_size + kChunk - 1) / kChunk;
  load_chunk(0);
  cp_async_commit();

  const int warp = tid / 32;
  const int lane = tid % 32;
  float acc[kTileCols / 8][4] = {};  // C fragments: columns [8n, 8n + 8) of the warp's 16 rows
  for (int chunk = 0; chunk < num_chunks; ++chunk) {
    if (chunk + 1 < num_chunks) load_chunk(chunk + 1);
    cp_async_commit();
    cp_async_wait<1>();  // this chunk landed for this thread...
    __syncthreads();     // ...and for all
    const T* xs = x_tile(chunk);
    const T* ws = w_tile(chunk);
#pragma unroll
    for (int ks = 0; ks < kChunk / 16; ++ks) {
      uint32_t a[4];
      ldmatrix_x4(a, xs + Tile::offset(warp * 16 + lane % 16, 2 * ks + lane / 16));
#pragma unroll
      for (int slice = 0; slice < kTileCols / 16; ++slice) {
        uint32_t b[4];
        ldmatrix_x4(b, ws + Tile::offset(slice * 16 + (lane / 16) * 8 + lane % 8, 2 * ks + (lane / 8) % 2));
        mma_m16n8k16<T>(acc[2 * slice], a, b[0], b[1]);
        mma_m16n8k16<T>(acc[2 * slice + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // everyone is done with this stage before it is reloaded
  }
  cp_async_wait<0>();

  const int g = lane / 4;
  const int q2 = 2 * (lane % 4);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row_begin + warp * 16 + g + 8 * half;
    if (row >= row_end) continue;
    T* dst = out + static_cast<int64_t>(row) * n_size;
#pragma unroll
    for (int n = 0; n < kTileCols / 8; ++n) {
      const int col = n0 + 8 * n + q2;
      if (col < n_size) dst[col] = from_float<T>(acc[n][2 * half]);
      if (col + 1 < n_size) dst[col + 1] = from_float<T>(acc[n][2 * half + 1]);
    }
  }
}

// The expert of row `row`: the last e with offsets[e] <= row (empty experts
// share their offset with the next one), or -1 outside [offsets[0], offsets[E]).
__device__ __forceinline__ int find_expert(const int32_t* offsets, int num_experts, int row) {
  if (row < offsets[0] || row >= offsets[num_experts]) return -1;
  int lo = 0;
  int hi = num_experts;  // invariant: offsets[lo] <= row < offsets[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (offsets[mid] <= row) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

__global__ void __launch_bounds__(kF32Threads) grouped_f32_kernel(float* out, const float* x, const float* weight,
                                                                  const int32_t* offsets, int num_experts,
                                                                  int n_size, int k_size) {
  const int row = static_cast<int>(blockIdx.x);
  const int n = static_cast<int>(blockIdx.y) * kF32Threads + static_cast<int>(threadIdx.x);
  const int expert = find_expert(offsets, num_experts, row);
  if (expert < 0 || n >= n_size) return;
  const float* xr = x + static_cast<int64_t>(row) * k_size;
  const float* w = weight + (static_cast<int64_t>(expert) * n_size + n) * k_size;
  float acc = 0.f;
  for (int k = 0; k < k_size; ++k) acc = fmaf(xr[k], w[k], acc);
  out[static_cast<int64_t>(row) * n_size + n] = acc;
}

}  // namespace grouped

void grouped_linear(const TensorView& out, const TensorView& x, const TensorView& weight,
                    const TensorView& expert_offsets, cudaStream_t stream) {
  using namespace grouped;
  ops::check_grouped_linear(ops::Device::kCUDA, out, x, weight, expert_offsets);
  const int rows = checked_int(kOp, "rows", x.size(0));
  const int k_size = checked_int(kOp, "in_features", x.size(1));
  const int n_size = checked_int(kOp, "out_features", weight.size(1));
  const int num_experts = checked_int(kOp, "num_experts", weight.size(0));
  checked_int(kOp, "weight elements", weight.numel());
  checked_int(kOp, "out elements", out.numel());
  if (rows == 0 || n_size == 0 || num_experts == 0) return;
  const auto* offsets = expert_offsets.ptr<const int32_t>();
  DeviceGuard guard(x.device_index);
  dispatch_float(x.dtype, kOp, [&]<typename T>() {
    if constexpr (std::is_same_v<T, float>) {
      const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(ceil_div(n_size, kF32Threads)));
      grouped_f32_kernel<<<grid, kF32Threads, 0, stream>>>(out.ptr<float>(), x.ptr<const float>(),
                                                           weight.ptr<const float>(), offsets, num_experts, n_size,
                                                           k_size);
      check_launch("grouped_f32_kernel");
    } else {
      PS_REQUIRE(k_size % 8 == 0, kOp, "16-bit x needs in_features % 8 == 0 (16-byte rows), got " +
                                           std::to_string(k_size));
      PS_REQUIRE(is_aligned16(x.data) && is_aligned16(weight.data), kOp, "x and weight must be 16-byte aligned");
      const int64_t row_tiles = ceil_div(rows, kTileRows) + int64_t{num_experts};
      PS_REQUIRE(row_tiles <= 65535, kOp, "at most 65535 row tiles (ceil(rows / 64) + experts) per call");
      const dim3 grid(static_cast<unsigned>(ceil_div(n_size, kTileCols)), static_cast<unsigned>(row_tiles));
      auto* kernel = grouped_mma_kernel<T>;
      allow_dynamic_smem(kernel, SharedLayout<T>::kBytes, "grouped_mma_kernel");
      kernel<<<grid, kThreads, SharedLayout<T>::kBytes, stream>>>(out.ptr<T>(), x.ptr<const T>(),
                                                                   weight.ptr<const T>(), offsets, num_experts,
                                                                   rows, n_size, k_size);
      check_launch("grouped_mma_kernel");
    }
  });
}

}  // namespace pagedserve::cuda
