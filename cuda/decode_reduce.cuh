// decode_reduce_kernel: the last step of split-K decode attention
// (decode_attention.cuh). One warp per (row, query head) merges the row's
// live partitions, each O / l with its max m and sum l, into
// O = sum_i w_i (O / l)_i / sum_i w_i with w_i = l_i exp2(m_i - max m).
// It reads seq_lens: the grid was sized from max_seq_len, and partitions past
// a row's context hold nothing.
#pragma once

#include <cstdint>

#include "attention_common.cuh"
#include "attention_params.h"
#include "dependent_launch.cuh"
#include "float_convert.cuh"

namespace pagedserve::cuda {
namespace decode {

inline constexpr int kReduceWarpsPerBlock = 4;

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kReduceWarpsPerBlock * 32)
    decode_reduce_kernel(const PagedAttentionParams p, const DecodeSplit split) {
  wait_for_previous_kernel();  // launched dependent: the partitions come from the kernel before
  let_next_kernel_launch();
  constexpr int kPerLane = kHeadDim / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp_index = static_cast<int>(blockIdx.x) * kReduceWarpsPerBlock + static_cast<int>(threadIdx.x) / 32;
  const int row = warp_index / p.num_heads;
  const int head = warp_index % p.num_heads;
  if (row >= p.num_decodes) return;
  const int num_live = live_partitions(p.seq_lens[row], p.window_span, split.partition_tokens, split.num_partitions);
  if (num_live <= 1) return;  // written by the partition kernel
  const int64_t first_slot = (static_cast<int64_t>(row) * p.num_heads + head) * split.num_partitions;

  float global_max = -INFINITY;
  for (int i = lane; i < num_live; i += 32) global_max = fmaxf(global_max, split.partial_max[first_slot + i]);
  global_max = warp_max(global_max);

  float acc[kPerLane] = {};
  float total = 0.f;
#pragma unroll 4
  for (int i = 0; i < num_live; ++i) {
    const int64_t slot = first_slot + i;
    const float weight = split.partial_sum[slot] * exp2f(split.partial_max[slot] - global_max);
    total += weight;
    float part[kPerLane];
    load_as_float(part, split.partial_out + slot * kHeadDim + lane * kPerLane);
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) acc[e] += weight * part[e];
  }
  const float inv_total = 1.f / total;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) acc[e] *= inv_total;
  const int token = p.query_start_loc[row];
  T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(token) * p.num_heads + head) * kHeadDim + lane * kPerLane;
  store_from_float(out, acc);
}

}  // namespace decode
}  // namespace pagedserve::cuda
