// The attention's input straight from a decode step's hidden rows: the qkv
// projection, rope and the KV-cache write in one kernel (semantics:
// ops::qkv_linear_rope_cache, which is small_batch_linear then qkv_rope_cache).
//
// Why: at batch 1 the two kernels it replaces run back to back in every layer,
// and the second, tiny one (2.4 us each, 54 us of a 1.2 ms TinyLlama decode
// step on an H200, bench/perf/decode_kernels.py) is pure latency: a launch,
// a read of the 5 KiB qkv row just written, a scattered write.
//
// Work items, one per warp: a rotation pair (dims i and R / 2 + i) of a q or k
// head, two rows of W and so two dot products (small_batch_dot.cuh); a dim of
// a q or k head past R; a dim of a v head. Lane m finishes token m: its
// values rounded to T as small_batch_linear stores qkv, rotated with
// rotary_math.cuh's arithmetic as qkv_rope_cache does, so the results are bit
// for bit those of the two kernels. Positions outside the table leave q and k
// unrotated; a negative slot or one past the cache writes no KV.
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
#include "small_batch_dot.cuh"

namespace pagedserve::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
using small_batch::kLanes;

// Column `col` of the product for the calling lane's token, rounded as small_batch_linear stores it.
template <typename T, int kRows>
__device__ __forceinline__ float product_value(const float (&acc)[kRows], const T* bias, int col, int lane) {
  float value = small_batch::row_of_lane(acc, lane);
  if (bias != nullptr) value += to_float(bias[col]);
  return round_through<T>(value);
}

template <typename T, int kRows>
__global__ void __launch_bounds__(kWarpsPerBlock* kLanes)
    qkv_linear_rope_cache_kernel(T* query_out, const T* __restrict__ x, const T* __restrict__ weight,
                                 const T* __restrict__ bias, int k_size, const int32_t* positions,
                                 const float* cos_sin, T* key_cache, T* value_cache, const int32_t* slot_mapping,
                                 QkvShape shape) {
  const int lane = static_cast<int>(threadIdx.x) % kLanes;
  const int item = static_cast<int>(blockIdx.x) * kWarpsPerBlock + static_cast<int>(threadIdx.x) / kLanes;
  wait_for_previous_kernel();  // x comes from the kernel before
  let_next_kernel_launch();
  const int d = shape.head_dim, half = shape.rotary_dim / 2;
  const int rotated_heads = shape.num_query_heads + shape.num_kv_heads;
  const int items_per_rotated_head = half + (d - shape.rotary_dim);
  const int rotated_items = rotated_heads * items_per_rotated_head;
  if (item >= rotated_items + shape.num_kv_heads * d) return;  // whole warps: the shuffles stay full-warp
  int head, dim;
  bool pair = false;
  if (item < rotated_items) {
    head = item / items_per_rotated_head;
    const int j = item % items_per_rotated_head;
    pair = j < half;
    dim = pair ? j : shape.rotary_dim + (j - half);
  } else {
    head = rotated_heads + (item - rotated_items) / d;
    dim = (item - rotated_items) % d;
  }
  const int col = head * d + dim;  // qkv's columns: q heads, k heads, v heads
  const T* row = weight + static_cast<int64_t>(col) * k_size;
  // A single column dots its row twice (the second pass reads L1): one loop for every warp keeps the
  // registers at the gated product's count (two loops: 138 at one bf16 row, spills in float32).
  float acc[kRows] = {}, acc2[kRows] = {};
  const T* row2 = pair ? row + static_cast<int64_t>(half) * k_size : row;
  small_batch::warp_dot<T, kRows, true>(acc, acc2, row, row2, x, k_size, lane);
  if (lane >= kRows) return;
  const int token = lane;
  const bool is_query = head < shape.num_query_heads, is_value = head >= rotated_heads;
  const int64_t slot = slot_mapping[token];
  const bool cached = slot >= 0 && slot < shape.num_slots;
  if (!is_query && !cached) return;
  T* dst;
  if (is_query) {
    dst = query_out + (static_cast<int64_t>(token) * shape.num_query_heads + head) * d;
  } else {
    const int kv_head = head - (is_value ? rotated_heads : shape.num_query_heads);
    dst = (is_value ? value_cache : key_cache) +
          cache_row_offset(slot / shape.block_size, kv_head, static_cast<int>(slot % shape.block_size),
                           shape.num_kv_heads, shape.block_size, d);
  }
  float out1 = product_value<T, kRows>(acc, bias, col, lane);
  if (pair) {
    float out2 = product_value<T, kRows>(acc2, bias, col + half, lane);
    const int position = positions[token];
    if (position >= 0 && position < shape.max_position) {
      const float* cos = cos_sin + static_cast<int64_t>(position) * shape.rotary_dim;
      rotate_values<T>(out1, out2, cos[dim], cos[half + dim], out1, out2);
    }
    dst[half + dim] = from_float<T>(out2);
  }
  dst[dim] = from_float<T>(out1);
}

// Row counts compiled: 1..ops::kMaxFusedQkvRows (the contract checked them).
template <typename Fn>
void dispatch_fused_rows(int rows, Fn&& fn) {
  static_assert(ops::kMaxFusedQkvRows == 4);
  switch (rows) {
    case 1: return fn.template operator()<1>();
    case 2: return fn.template operator()<2>();
    case 3: return fn.template operator()<3>();
    default: return fn.template operator()<4>();
  }
}

}  // namespace

void qkv_linear_rope_cache(const TensorView& query_out, const TensorView& x, const TensorView& weight,
                           const TensorView& bias, const TensorView& positions, const TensorView& cos_sin,
                           const TensorView& key_cache, const TensorView& value_cache,
                           const TensorView& slot_mapping, cudaStream_t stream) {
  constexpr const char* kOp = "qkv_linear_rope_cache";
  ops::check_qkv_linear_rope_cache(ops::Device::kCUDA, query_out, x, weight, bias, positions, cos_sin, key_cache,
                                   value_cache, slot_mapping);
  const QkvShape shape = QkvShape::of(kOp, query_out, key_cache, cos_sin);
  const int k_size = checked_int(kOp, "K", x.size(1));
  const int items = (shape.num_query_heads + shape.num_kv_heads) * (shape.head_dim - shape.rotary_dim / 2) +
                    shape.num_kv_heads * shape.head_dim;
  DeviceGuard guard(x.device_index);
  dispatch_float(x.dtype, kOp, [&]<typename T>() {
    small_batch::require_vector_operands<T>(kOp, x, weight);
    const T* bias_ptr = bias.data == nullptr ? nullptr : bias.ptr<const T>();
    dispatch_fused_rows(static_cast<int>(x.size(0)), [&]<int kRows>() {
      launch_dependent(qkv_linear_rope_cache_kernel<T, kRows>, dim3(ceil_div(items, kWarpsPerBlock)),
                       dim3(kWarpsPerBlock * kLanes), 0, stream, "qkv_linear_rope_cache_kernel", query_out.ptr<T>(),
                       x.ptr<const T>(), weight.ptr<const T>(), bias_ptr, k_size, positions.ptr<const int32_t>(),
                       cos_sin.ptr<const float>(), key_cache.ptr<T>(), value_cache.ptr<T>(),
                       slot_mapping.ptr<const int32_t>(), shape);
    });
  });
}

}  // namespace pagedserve::cuda
