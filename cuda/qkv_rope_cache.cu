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
// rotary_math.cuh's, as rotary_embedding's, so the result is bit-identical to rotary_embedding
// followed by reshape_and_cache. Tokens whose position is outside the table
// keep their keys and queries unrotated (as rotary_embedding leaves them);
// tokens with a negative slot, or a slot past the cache, write no KV.
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

template <typename T, int kVec>
__global__ void __launch_bounds__(kMaxBlockThreads)
    qkv_rope_cache_kernel(T* query_out, const T* qkv, const int32_t* positions, const float* cos_sin, T* key_cache,
                          T* value_cache, const int32_t* slot_mapping, QkvShape shape) {
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
  const int num_items = rotated_heads * (pair_chunks + tail_chunks) + shape.num_kv_heads * head_chunks;
  const T* row = qkv + static_cast<int64_t>(token) * (rotated_heads + shape.num_kv_heads) * d;
  for (int item = static_cast<int>(threadIdx.x); item < num_items; item += static_cast<int>(blockDim.x)) {
    if (item < rotated_heads * (pair_chunks + tail_chunks)) {  // a q or k head: rotation pairs, then the tail
      const int head = item / (pair_chunks + tail_chunks), j = item % (pair_chunks + tail_chunks);
      const bool is_query = head < shape.num_query_heads;
      if (!is_query && !cached) continue;
      const T* src = row + static_cast<int64_t>(head) * d;  // q heads, then k heads: qkv's column order
      T* dst = is_query ? query_out + (static_cast<int64_t>(token) * shape.num_query_heads + head) * d
                        : key_cache + cache_row_offset(block, head - shape.num_query_heads, offset, shape.num_kv_heads,
                                                       shape.block_size, d);
      if (j >= pair_chunks) {
        const int i = shape.rotary_dim + (j - pair_chunks) * kVec;
        copy_chunk<T, kVec>(dst + i, src + i);
      } else if (rotate) {
        rotate_pair<T, kVec>(dst, src, cos, sin, half, j * kVec);
      } else {
        copy_chunk<T, kVec>(dst + j * kVec, src + j * kVec);
        copy_chunk<T, kVec>(dst + half + j * kVec, src + half + j * kVec);
      }
    } else if (cached) {  // a v head
      const int v = item - rotated_heads * (pair_chunks + tail_chunks);
      const int head = v / head_chunks, i = v % head_chunks * kVec;
      const T* src = row + static_cast<int64_t>(rotated_heads + head) * d + i;
      copy_chunk<T, kVec>(value_cache + cache_row_offset(block, head, offset, shape.num_kv_heads, shape.block_size, d) + i,
                          src);
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
                    const TensorView& slot_mapping, cudaStream_t stream) {
  constexpr const char* kOp = "qkv_rope_cache";
  ops::check_qkv_rope_cache(ops::Device::kCUDA, query_out, qkv, positions, cos_sin, key_cache, value_cache,
                            slot_mapping);
  const QkvShape shape = QkvShape::of(kOp, query_out, key_cache, cos_sin);
  const int grid = checked_int(kOp, "num_tokens", qkv.size(0));
  if (grid == 0) return;
  DeviceGuard guard(qkv.device_index);
  dispatch_float(qkv.dtype, kOp, [&]<typename T>() {
    dispatch_vector_width<T>(can_vectorize<T>(query_out, qkv, key_cache, value_cache, cos_sin, shape),
                             [&]<int kVec>() {
      const int items = (shape.num_query_heads + 2 * shape.num_kv_heads) * (shape.head_dim / kVec);
      const int threads = std::clamp((items + 31) / 32 * 32, 32, kMaxBlockThreads);
      launch_dependent(qkv_rope_cache_kernel<T, kVec>, dim3(grid), dim3(threads), 0, stream, "qkv_rope_cache_kernel",
                       query_out.ptr<T>(), qkv.ptr<const T>(), positions.ptr<const int32_t>(),
                       cos_sin.ptr<const float>(), key_cache.ptr<T>(), value_cache.ptr<T>(),
                       slot_mapping.ptr<const int32_t>(), shape);
    });
  });
}

}  // namespace pagedserve::cuda
