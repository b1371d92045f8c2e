// Rotary position embedding, half rotation (NeoX / Llama / Qwen), in place.
//
// Tiling: one block per token. Its threads walk the (head, chunk) pairs of the
// token's Hq + Hkv heads; a chunk is kVec consecutive rotary indices i, for
// which a thread loads x1 = x[i..], x2 = x[R/2 + i..] and the matching cos and
// sin (float32) with 16-byte accesses, and writes both halves back.
// Dims past the rotary dim R are untouched (partial rotary).
//
// Bytes per token: (Hq + Hkv) * R elements read and written, plus R floats of
// cos/sin (shared by every head, L1 resident).
#include <algorithm>

#include "cuda_check.h"
#include "cuda_ops.h"
#include "dispatch.h"
#include "float_convert.cuh"
#include "launch_limits.h"
#include "ops/op_contracts.h"
#include "rotary_math.cuh"

namespace pagedserve::cuda {
namespace {

constexpr int kMaxBlockThreads = 256;

struct RotaryShape {
  int num_query_heads;
  int num_kv_heads;
  int head_dim;
  int rotary_dim;
  int max_position;
};

template <typename T, int kVec>
__global__ void __launch_bounds__(kMaxBlockThreads)
    rotary_embedding_kernel(const int32_t* positions, T* query, T* key, const float* cos_sin, RotaryShape shape) {
  const int token = static_cast<int>(blockIdx.x);
  const int position = positions[token];
  if (position < 0 || position >= shape.max_position) return;
  const int half = shape.rotary_dim / 2;
  const float* cos = cos_sin + static_cast<int64_t>(position) * shape.rotary_dim;
  const float* sin = cos + half;
  const int chunks_per_head = half / kVec;
  const int num_chunks = (shape.num_query_heads + shape.num_kv_heads) * chunks_per_head;
  for (int c = static_cast<int>(threadIdx.x); c < num_chunks; c += static_cast<int>(blockDim.x)) {
    const int head = c / chunks_per_head;
    const int i = c % chunks_per_head * kVec;
    T* x = head < shape.num_query_heads
               ? query + (static_cast<int64_t>(token) * shape.num_query_heads + head) * shape.head_dim
               : key + (static_cast<int64_t>(token) * shape.num_kv_heads + head - shape.num_query_heads) *
                           shape.head_dim;
    rotate_pair<T, kVec>(x, x, cos, sin, half, i);
  }
}

// 16-byte chunks need every x1/x2/cos/sin start aligned: R/2 a multiple of the
// vector width (which also keeps float cos/sin rows aligned) and D * sizeof(T) of 16.
template <typename T>
bool can_vectorize(const TensorView& query, const TensorView& key, const TensorView& cos_sin, const RotaryShape& s) {
  const int half = s.rotary_dim / 2;
  return half % kVec16<T> == 0 && half % 4 == 0 && s.head_dim % kVec16<T> == 0 && is_aligned16(query.data) &&
         is_aligned16(key.data) && is_aligned16(cos_sin.data);
}

}  // namespace

void rotary_embedding(const TensorView& positions, const TensorView& query, const TensorView& key,
                      const TensorView& cos_sin, cudaStream_t stream) {
  constexpr const char* kOp = "rotary_embedding";
  ops::check_rotary_embedding(ops::Device::kCUDA, positions, query, key, cos_sin);
  const int64_t num_tokens = query.size(0);
  const RotaryShape shape{checked_int(kOp, "query heads", query.size(1)), checked_int(kOp, "kv heads", key.size(1)),
                          checked_int(kOp, "head_dim", query.size(2)), checked_int(kOp, "rotary dim", cos_sin.size(1)),
                          checked_int(kOp, "max_position", cos_sin.size(0))};
  const int grid = checked_int(kOp, "num_tokens", num_tokens);
  if (grid == 0) return;
  DeviceGuard guard(query.device_index);
  dispatch_float(query.dtype, kOp, [&]<typename T>() {
    dispatch_vector_width<T>(can_vectorize<T>(query, key, cos_sin, shape), [&]<int kVec>() {
      const int num_chunks = (shape.num_query_heads + shape.num_kv_heads) * (shape.rotary_dim / 2 / kVec);
      const int block = std::min(kMaxBlockThreads, std::max(32, ceil_div(num_chunks, 32) * 32));
      rotary_embedding_kernel<T, kVec><<<grid, block, 0, stream>>>(positions.ptr<const int32_t>(), query.ptr<T>(),
                                                                   key.ptr<T>(), cos_sin.ptr<const float>(), shape);
      check_launch("rotary_embedding_kernel");
    });
  });
}

}  // namespace pagedserve::cuda
