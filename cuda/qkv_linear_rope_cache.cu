// The attention's input straight from a decode step's hidden rows: the qkv
// projection, rope and the KV-cache write in one kernel (semantics:
// ops::qkv_linear_rope_cache, which is small_batch_linear then qkv_rope_cache).
//
// Why: at batch 1 the two kernels it replaces run back to back in every layer,
// and the second, tiny one (2.4 us each, 54 us of a 1.2 ms TinyLlama decode
// step on an H200, bench/perf/decode_kernels.py) is pure latency: a launch,
// a read of the 5 KiB qkv row just written, a scattered write.
//
// Work, one qkv column per warp (a row of W, small_batch_dot.cuh): a block of
// 8 warps takes either 4 rotation pairs (dims i and R / 2 + i of a q or k head;
// warp w and w + 4 hold the pair's two columns and meet in shared memory) or 8
// single columns (dims of a q or k head past R, dims of v heads). One row of W
// per warp, as in small_batch_linear: an earlier layout gave a pair's two rows
// to one warp (and a single column's row twice), 6.5 us per TinyLlama layer
// against the product's 4.4 us for the same 10.5 MB on an H200. Lane m
// finishes token m: its values rounded to T as small_batch_linear stores qkv,
// rotated with rotary_math.cuh's arithmetic as qkv_rope_cache does, so the
// results are bit for bit those of the two kernels. Positions outside the
// table leave q and k unrotated; a negative slot or one past the cache writes
// no KV.
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

constexpr int kWarpsPerBlock = 8;
constexpr int kPairsPerBlock = kWarpsPerBlock / 2;
using small_batch::kLanes;

// Column `col` of the product for the calling lane's token, rounded as small_batch_linear stores it.
template <typename T, int kRows>
__device__ __forceinline__ float product_value(const float (&acc)[kRows], const T* bias, int col, int lane) {
  float value = small_batch::row_of_lane(acc, lane);
  if (bias != nullptr) value += to_float(bias[col]);
  return round_through<T>(value);
}

// How the columns of qkv fall into blocks: pair blocks first, then single blocks.
struct QkvWork {
  int half;           // R / 2
  int rotated_heads;  // q and k heads
  int num_pairs;      // rotated_heads * half
  int pair_blocks;
  int partial_dims;   // dims past R in a q or k head
  int num_singles;    // rotated_heads * partial_dims + kv heads * D
  int single_blocks;

  __host__ __device__ static QkvWork of(const QkvShape& s) {
    QkvWork w{};
    w.half = s.rotary_dim / 2;
    w.rotated_heads = s.num_query_heads + s.num_kv_heads;
    w.num_pairs = w.rotated_heads * w.half;
    w.pair_blocks = (w.num_pairs + kPairsPerBlock - 1) / kPairsPerBlock;
    w.partial_dims = s.head_dim - s.rotary_dim;
    w.num_singles = w.rotated_heads * w.partial_dims + s.num_kv_heads * s.head_dim;
    w.single_blocks = (w.num_singles + kWarpsPerBlock - 1) / kWarpsPerBlock;
    return w;
  }
};

// Where token `token`'s values of head `head` go: the query output or its KV-cache row (nullptr: no slot).
template <typename T>
__device__ __forceinline__ T* head_row(T* query_out, T* key_cache, T* value_cache, const int32_t* slot_mapping,
                                       const QkvShape& shape, int rotated_heads, int head, int token) {
  const int d = shape.head_dim;
  if (head < shape.num_query_heads) return query_out + (static_cast<int64_t>(token) * shape.num_query_heads + head) * d;
  const int64_t slot = slot_mapping[token];
  if (slot < 0 || slot >= shape.num_slots) return nullptr;
  const bool is_value = head >= rotated_heads;
  const int kv_head = head - (is_value ? rotated_heads : shape.num_query_heads);
  return (is_value ? value_cache : key_cache) + cache_row_offset(slot / shape.block_size, kv_head,
                                                                 static_cast<int>(slot % shape.block_size),
                                                                 shape.num_kv_heads, shape.block_size, d);
}

template <typename T, int kRows>
__global__ void __launch_bounds__(kWarpsPerBlock* kLanes)
    qkv_linear_rope_cache_kernel(T* query_out, const T* __restrict__ x, const T* __restrict__ weight,
                                 const T* __restrict__ bias, int k_size, const int32_t* positions,
                                 const float* cos_sin, T* key_cache, T* value_cache, const int32_t* slot_mapping,
                                 QkvShape shape) {
  __shared__ float partner[kPairsPerBlock][kRows];  // the second column of each pair, per token
  const int lane = static_cast<int>(threadIdx.x) % kLanes;
  const int warp = static_cast<int>(threadIdx.x) / kLanes;
  const QkvWork work = QkvWork::of(shape);
  const int d = shape.head_dim;
  wait_for_previous_kernel();  // x comes from the kernel before
  let_next_kernel_launch();
  const int block = static_cast<int>(blockIdx.x);
  if (block < work.pair_blocks) {
    // Rotation pairs: warp w < 4 computes dim i of pair 4 * block + w, warp w + 4 its dim R / 2 + i.
    const int pair = block * kPairsPerBlock + warp % kPairsPerBlock;
    const bool valid = pair < work.num_pairs;  // no early return: the block meets at a barrier below
    const int head = valid ? pair / work.half : 0, dim = valid ? pair % work.half : 0;
    const bool second = warp >= kPairsPerBlock;
    const int col = head * d + dim + (second ? work.half : 0);
    float acc[kRows] = {}, unused[kRows] = {};
    if (valid) small_batch::warp_dot<T, kRows, false>(acc, unused, weight + static_cast<int64_t>(col) * k_size,
                                                      nullptr, x, k_size, lane);
    const float value = valid && lane < kRows ? product_value<T, kRows>(acc, bias, col, lane) : 0.f;
    if (second && lane < kRows) partner[warp - kPairsPerBlock][lane] = value;
    __syncthreads();
    if (second || !valid || lane >= kRows) return;
    const int token = lane;
    T* dst = head_row(query_out, key_cache, value_cache, slot_mapping, shape, work.rotated_heads, head, token);
    if (dst == nullptr) return;
    float out1 = value, out2 = partner[warp][lane];
    const int position = positions[token];
    if (position >= 0 && position < shape.max_position) {
      const float* cos = cos_sin + static_cast<int64_t>(position) * shape.rotary_dim;
      rotate_values<T>(out1, out2, cos[dim], cos[work.half + dim], out1, out2);
    }
    dst[dim] = from_float<T>(out1);
    dst[work.half + dim] = from_float<T>(out2);
    return;
  }
  // Single columns: the dims of q / k heads past R, then the v heads.
  const int single = (block - work.pair_blocks) * kWarpsPerBlock + warp;
  if (single >= work.num_singles) return;  // whole warps: the shuffles stay full-warp
  const int partial_items = work.rotated_heads * work.partial_dims;
  int head, dim;
  if (single < partial_items) {
    head = single / work.partial_dims;
    dim = shape.rotary_dim + single % work.partial_dims;
  } else {
    head = work.rotated_heads + (single - partial_items) / d;
    dim = (single - partial_items) % d;
  }
  const int col = head * d + dim;  // qkv's columns: q heads, k heads, v heads
  float acc[kRows] = {}, unused[kRows] = {};
  small_batch::warp_dot<T, kRows, false>(acc, unused, weight + static_cast<int64_t>(col) * k_size, nullptr, x,
                                         k_size, lane);
  if (lane >= kRows) return;
  T* dst = head_row(query_out, key_cache, value_cache, slot_mapping, shape, work.rotated_heads, head, lane);
  if (dst != nullptr) dst[dim] = from_float<T>(product_value<T, kRows>(acc, bias, col, lane));
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
  const QkvWork work = QkvWork::of(shape);
  const int blocks = work.pair_blocks + work.single_blocks;
  DeviceGuard guard(x.device_index);
  dispatch_float(x.dtype, kOp, [&]<typename T>() {
    small_batch::require_vector_operands<T>(kOp, x, weight);
    const T* bias_ptr = bias.data == nullptr ? nullptr : bias.ptr<const T>();
    dispatch_fused_rows(static_cast<int>(x.size(0)), [&]<int kRows>() {
      launch_dependent(qkv_linear_rope_cache_kernel<T, kRows>, dim3(blocks),
                       dim3(kWarpsPerBlock * kLanes), 0, stream, "qkv_linear_rope_cache_kernel", query_out.ptr<T>(),
                       x.ptr<const T>(), weight.ptr<const T>(), bias_ptr, k_size, positions.ptr<const int32_t>(),
                       cos_sin.ptr<const float>(), key_cache.ptr<T>(), value_cache.ptr<T>(),
                       slot_mapping.ptr<const int32_t>(), shape);
    });
  });
}

}  // namespace pagedserve::cuda
