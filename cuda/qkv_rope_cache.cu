// The attention's input in one pass: from the qkv projection's output, the
// rotated queries (a contiguous [T, Hq, D] tensor for the attention kernel) and
// the rotated keys and the values written into their KV-cache slots.
//
// Unfused, a decode step spent five launches per layer on this (three copies
// of the q / k / v column slices when T > 1, rotary_embedding,
// reshape_and_cache: 66 copy kernels, 150 us of a TinyLlama batch-64 step on
// an H200, bench/perf/decode_kernels.py) and wrote and re-read the keys once
// more. Tiling: one block per token; its threads walk 16-byte chunks of the
// token's heads: for q and k heads a chunk of rotation pairs (x[i..], x[R/2 +
// i..]) or of the dims past R, for v heads a plain chunk. The arithmetic is
// rotary_math.cuh's, as rotary_embedding's, so the result is bit-identical to
// rotary_embedding followed by reshape_and_cache. Tokens whose position is
// outside the table keep their keys and queries unrotated (as
// rotary_embedding leaves them); tokens with a negative slot, or a slot past
// the cache, write no KV.
// With a QkNorm (Qwen3's q_norm / k_norm) each q and k head is normalized
// first, bit for bit as rms_norm normalizes it (head_sum below): unfused that
// is seven launches a layer (three copies, two norms, rope, the cache write);
// fused, a Qwen3-0.6B decode step on an H100 went from 340 to 256 kernels and
// from 1.62 to 1.27 ms of device time at batch 1 (2.49 to 1.97 ms at 64).
#include <algorithm>

#include "cuda_check.h"
#include "cuda_ops.h"
#include "dependent_launch.cuh"
#include "dispatch.h"
#include "float_convert.cuh"
#include "kv_cache_index.cuh"
#include "launch_limits.h"
#include "ops/op_contracts.h"
#include "qkv_shape.h"
#include "rotary_math.cuh"

namespace pagedserve::cuda {
namespace {

constexpr int kMaxBlockThreads = 256;

template <typename T, int kVec>
__device__ __forceinline__ void copy_chunk(T* dst, const T* src) {
  *reinterpret_cast<Vec<T, kVec>*>(dst) = *reinterpret_cast<const Vec<T, kVec>*>(src);
}

// A q / k head's per-head norm (qk_norm.h) in the layout of rms_norm_kernel
// for a row of D (norm_kernels.cu: D / kVec threads, thread l holding values
// [l kVec, (l + 1) kVec), each squaring its own in order, then an xor-shuffle
// tree from offset D / (2 kVec) down): here the thread of pair chunk j holds
// that kernel's threads j and j + D / (2 kVec), so its two sums, added, are
// that tree's first step, and the rest of the tree runs over the head's
// D / (2 kVec) threads (a power of two, aligned in the warp). Every thread of
// the block calls it (full-warp shuffles); `sum` is 0 where unused.
template <int kGroup>
__device__ __forceinline__ float head_sum(float sum) {
#pragma unroll
  for (int offset = kGroup / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  return sum;
}

template <typename T, int kVec>
__device__ __forceinline__ float sum_of_squares(const float (&x)[kVec]) {
  float sum = 0.f;
#pragma unroll
  for (int e = 0; e < kVec; ++e) sum += x[e] * x[e];  // as rms_norm_kernel: one contracted chain
  return sum;
}

// x = round(round(x inv_rms) w), rms_norm's two roundings.
template <typename T, int kVec>
__device__ __forceinline__ void normalize(float (&x)[kVec], float inv_rms, const T* weight) {
  float w[kVec];
  load_as_float(w, weight);
#pragma unroll
  for (int e = 0; e < kVec; ++e) x[e] = round_through<T>(round_through<T>(x[e] * inv_rms) * w[e]);
}

// kGroup: 0 without norms, else the pair chunks of a head (D / (2 kVec)), the
// threads a head's norm is summed over.
template <typename T, int kVec, int kGroup>
__global__ void __launch_bounds__(kMaxBlockThreads)
    qkv_rope_cache_kernel(T* query_out, const T* qkv, const int32_t* positions, const float* cos_sin, T* key_cache,
                          T* value_cache, const int32_t* slot_mapping, QkvShape shape, const T* q_norm,
                          const T* k_norm, float eps) {
  wait_for_previous_kernel();  // launched dependent: qkv comes from the kernel before
  let_next_kernel_launch();
  const int token = static_cast<int>(blockIdx.x);
  const int position = positions[token];
  const bool rotate = position >= 0 && position < shape.max_position;
  const int64_t slot = slot_mapping[token];
  const bool cached = slot >= 0 && slot < shape.num_slots;
  const int64_t block = cached ? slot / shape.block_size : 0;
  const int offset = cached ? static_cast<int>(slot % shape.block_size) : 0;
  const int d = shape.head_dim, half = shape.rotary_dim / 2;
  const float* cos = cos_sin + static_cast<int64_t>(rotate ? position : 0) * shape.rotary_dim;
  const float* sin = cos + half;
  const int pair_chunks = half / kVec, tail_chunks = (d - shape.rotary_dim) / kVec, head_chunks = d / kVec;
  const int rotated_heads = shape.num_query_heads + shape.num_kv_heads;
  const int rotated_items = rotated_heads * (pair_chunks + tail_chunks);
  const int num_items = rotated_items + shape.num_kv_heads * head_chunks;
  const T* row = qkv + static_cast<int64_t>(token) * (rotated_heads + shape.num_kv_heads) * d;
  // With norms the loop runs whole blocks of items, every thread to the end, for the shuffles.
  const int steps = (num_items + static_cast<int>(blockDim.x) - 1) / static_cast<int>(blockDim.x);
  for (int step = 0; step < steps; ++step) {
    const int item = step * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x);
    const bool rotated_item = item < rotated_items;
    const int head = rotated_item ? item / (pair_chunks + tail_chunks) : 0;
    const int j = rotated_item ? item % (pair_chunks + tail_chunks) : 0;
    const bool is_query = head < shape.num_query_heads;
    const T* src = row + static_cast<int64_t>(head) * d;  // q heads, then k heads: qkv's column order
    auto destination = [&]() {
      return is_query ? query_out + (static_cast<int64_t>(token) * shape.num_query_heads + head) * d
                      : key_cache + cache_row_offset(block, head - shape.num_query_heads, offset, shape.num_kv_heads,
                                                     shape.block_size, d);
    };
    if constexpr (kGroup > 0) {  // full rotary (no tail): a q / k item is pair chunk j of its head
      float x1[kVec] = {}, x2[kVec] = {};
      if (rotated_item) {
        load_as_float(x1, src + j * kVec);
        load_as_float(x2, src + half + j * kVec);
      }
      const float sum = head_sum<kGroup>(sum_of_squares<T>(x1) + sum_of_squares<T>(x2));  // every thread
      if (rotated_item) {
        if (!is_query && !cached) continue;
        const float inv_rms = 1.f / sqrtf(sum / static_cast<float>(d) + eps);
        const T* weight = is_query ? q_norm : k_norm;
        normalize<T>(x1, inv_rms, weight + j * kVec);
        normalize<T>(x2, inv_rms, weight + half + j * kVec);
        if (rotate) {
          float c[kVec], s[kVec];
          load_as_float(c, cos + j * kVec);
          load_as_float(s, sin + j * kVec);
#pragma unroll
          for (int e = 0; e < kVec; ++e) rotate_values<T>(x1[e], x2[e], c[e], s[e], x1[e], x2[e]);
        }
        T* dst = destination();
        store_from_float(dst + j * kVec, x1);
        store_from_float(dst + half + j * kVec, x2);
        continue;
      }
    }
    if (rotated_item) {  // a q or k head: rotation pairs, then the tail
      if (!is_query && !cached) continue;
      T* dst = destination();
      if (j >= pair_chunks) {
        const int i = shape.rotary_dim + (j - pair_chunks) * kVec;
        copy_chunk<T, kVec>(dst + i, src + i);
      } else if (rotate) {
        rotate_pair<T, kVec>(dst, src, cos, sin, half, j * kVec);
      } else {
        copy_chunk<T, kVec>(dst + j * kVec, src + j * kVec);
        copy_chunk<T, kVec>(dst + half + j * kVec, src + half + j * kVec);
      }
    } else if (item < num_items && cached) {  // a v head
      const int v = item - rotated_items;
      const int v_head = v / head_chunks, i = v % head_chunks * kVec;
      copy_chunk<T, kVec>(value_cache + cache_row_offset(block, v_head, offset, shape.num_kv_heads,
                                                         shape.block_size, d) + i,
                          row + static_cast<int64_t>(rotated_heads + v_head) * d + i);
    }
  }
}

template <typename T>
bool can_vectorize(const TensorView& query_out, const TensorView& qkv, const TensorView& key_cache,
                   const TensorView& value_cache, const TensorView& cos_sin, const QkvShape& s) {
  const int half = s.rotary_dim / 2;
  return half % kVec16<T> == 0 && half % 4 == 0 && s.head_dim % kVec16<T> == 0 && is_aligned16(query_out.data) &&
         is_aligned16(qkv.data) && is_aligned16(key_cache.data) && is_aligned16(value_cache.data) &&
         is_aligned16(cos_sin.data);
}

}  // namespace

void qkv_rope_cache(const TensorView& query_out, const TensorView& qkv, const TensorView& positions,
                    const TensorView& cos_sin, const TensorView& key_cache, const TensorView& value_cache,
                    const TensorView& slot_mapping, const ops::QkNorm& norm, cudaStream_t stream) {
  constexpr const char* kOp = "qkv_rope_cache";
  ops::check_qkv_rope_cache(ops::Device::kCUDA, query_out, qkv, positions, cos_sin, key_cache, value_cache,
                            slot_mapping, norm);
  const QkvShape shape = QkvShape::of(kOp, query_out, key_cache, cos_sin);
  const int grid = checked_int(kOp, "num_tokens", qkv.size(0));
  if (grid == 0) return;
  DeviceGuard guard(qkv.device_index);
  dispatch_float(qkv.dtype, kOp, [&]<typename T>() {
    const bool vectorized = can_vectorize<T>(query_out, qkv, key_cache, value_cache, cos_sin, shape);
    const T* q_norm = norm.applies() ? norm.q_weight.ptr<const T>() : nullptr;
    const T* k_norm = norm.applies() ? norm.k_weight.ptr<const T>() : nullptr;
    dispatch_vector_width<T>(vectorized, [&]<int kVec>() {
      const int items = (shape.num_query_heads + 2 * shape.num_kv_heads) * (shape.head_dim / kVec);
      const int threads = std::clamp((items + 31) / 32 * 32, 32, kMaxBlockThreads);
      auto launch = [&](auto kernel) {
        launch_dependent(kernel, dim3(grid), dim3(threads), 0, stream, "qkv_rope_cache_kernel", query_out.ptr<T>(),
                         qkv.ptr<const T>(), positions.ptr<const int32_t>(), cos_sin.ptr<const float>(),
                         key_cache.ptr<T>(), value_cache.ptr<T>(), slot_mapping.ptr<const int32_t>(), shape, q_norm,
                         k_norm, norm.eps);
      };
      if (!norm.applies()) return launch(qkv_rope_cache_kernel<T, kVec, 0>);
      // rms_norm_kernel's layout for a row of D (what this must sum like): 16-byte vectors, D / kVec threads.
      const int group = shape.head_dim / (2 * kVec);
      PS_REQUIRE(vectorized && kVec == kVec16<T> && shape.rotary_dim == shape.head_dim && shape.head_dim <= 128 &&
                     (group & (group - 1)) == 0, kOp,
                 "q/k norms need rope over the whole head (rotary dim == head dim), head_dim <= 128 with "
                 "head_dim / 2 a multiple of 16 bytes, and 16-byte aligned tensors; got head_dim " +
                     std::to_string(shape.head_dim) + ", rotary dim " + std::to_string(shape.rotary_dim));
      if constexpr (kVec == kVec16<T>) {
        switch (group) {  // D = 2 kVec group: 16 .. 128
          case 1: return launch(qkv_rope_cache_kernel<T, kVec, 1>);
          case 2: return launch(qkv_rope_cache_kernel<T, kVec, 2>);
          case 4: return launch(qkv_rope_cache_kernel<T, kVec, 4>);
          case 8: return launch(qkv_rope_cache_kernel<T, kVec, 8>);
          case 16: return launch(qkv_rope_cache_kernel<T, kVec, 16>);
          default: break;
        }
      }
    });
  });
}

}  // namespace pagedserve::cuda
