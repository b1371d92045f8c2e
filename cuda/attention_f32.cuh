// Float32 paged attention: a plain SIMT kernel for every row, decode or
// prefill. The engine runs float32 random-weight models on the GPU to compare
// with the CPU ops token by token, so exactness matters here, speed does not.
//
// One warp per (query token, query head); lane l owns dims [l * D/32, (l+1) * D/32).
// The warp finds its row by binary search in query_start_loc, then walks the
// token's visible keys 4 at a time (4 independent loads in flight), reducing
// each dot product with shuffles, with an online softmax in the log2 domain.
// A sliding window starts the walk at the window; soft-capping maps each score.
// Tokens past query_start_loc[S] (graph padding) are left unwritten.
// Cost: every (token, head) re-reads its keys from L2; fine for test-size models.
#pragma once

#include <cstdint>

#include "attention_common.cuh"
#include "attention_params.h"
#include "cuda_check.h"
#include "float_convert.cuh"
#include "smem_tile.cuh"

namespace pagedserve::cuda {
namespace simt {

inline constexpr int kWarpsPerBlock = 4;
inline constexpr int kKeysPerStep = 4;

// The row whose query range holds `token`: the last s with query_start_loc[s] <= token.
__device__ __forceinline__ int find_row(const int32_t* query_start_loc, int num_seqs, int token) {
  int lo = 0;
  int hi = num_seqs;  // invariant: query_start_loc[lo] <= token < query_start_loc[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (query_start_loc[mid] <= token) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

template <int kHeadDim, int kBlockSize>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) attention_f32_kernel(const PagedAttentionParams p) {
  constexpr int kPerLane = kHeadDim / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t warp_index =
      static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + static_cast<int>(threadIdx.x) / 32;
  const int token = static_cast<int>(warp_index / p.num_heads);
  const int head = static_cast<int>(warp_index % p.num_heads);
  if (token >= p.num_tokens) return;
  if (token < p.query_start_loc[0] || token >= p.query_start_loc[p.num_seqs]) return;
  const int row = find_row(p.query_start_loc, p.num_seqs, token);
  const int q_begin = p.query_start_loc[row];
  const int q_len = p.query_start_loc[row + 1] - q_begin;
  const int seq_len = p.seq_lens[row];
  const int query_pos = seq_len - q_len + (token - q_begin);
  const int num_keys = min(query_pos + 1, seq_len);  // causal
  const int key_begin = query_pos >= p.window_span ? query_pos - p.window_span + 1 : 0;
  const int kv_head = head / (p.num_heads / p.num_kv_heads);
  const int32_t* block_table = p.block_tables + static_cast<int64_t>(row) * p.max_blocks_per_seq;
  const auto* key_cache = static_cast<const float*>(p.key_cache);
  const auto* value_cache = static_cast<const float*>(p.value_cache);
  const int lane_dim = lane * kPerLane;

  float q[kPerLane];
  load_as_float(q, static_cast<const float*>(p.query) + (static_cast<int64_t>(token) * p.num_heads + head) * kHeadDim +
                       lane_dim);
  const ScoreMap score_map = ScoreMap::make(p.scale, p.softcap);
  const float q_scale = score_map.capped ? 1.f : score_map.scale_log2;  // capped: the map scales
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) q[e] *= q_scale;

  float running_max = -INFINITY;
  float running_sum = 0.f;
  float acc[kPerLane] = {};
  for (int first = key_begin; first < num_keys; first += kKeysPerStep) {
    float score[kKeysPerStep];
    float value[kKeysPerStep][kPerLane];
#pragma unroll
    for (int k = 0; k < kKeysPerStep; ++k) {
      const int key = first + k;
      float partial = 0.f;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) value[k][e] = 0.f;
      if (key < num_keys) {
        const int64_t offset = cache_row_offset(block_table[key / kBlockSize], kv_head, key % kBlockSize,
                                                p.num_kv_heads, kBlockSize, kHeadDim) +
                               lane_dim;
        float k_vec[kPerLane];
        load_as_float(k_vec, key_cache + offset);
        load_as_float(value[k], value_cache + offset);
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) partial += q[e] * k_vec[e];
      }
      score[k] = partial;
    }
    float step_max = -INFINITY;
#pragma unroll
    for (int k = 0; k < kKeysPerStep; ++k) {
      const float dot = warp_sum(score[k]);
      score[k] = first + k >= num_keys ? -INFINITY : score_map.capped ? score_map.capped_score(dot) : dot;
      step_max = fmaxf(step_max, score[k]);
    }
    const float new_max = fmaxf(running_max, step_max);  // finite: key `first` is visible
    const float rescale = exp2f(running_max - new_max);
    running_sum *= rescale;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) acc[e] *= rescale;
#pragma unroll
    for (int k = 0; k < kKeysPerStep; ++k) {
      const float weight = exp2f(score[k] - new_max);
      running_sum += weight;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) acc[e] += weight * value[k][e];
    }
    running_max = new_max;
  }
  const float inv_sum = running_sum > 0.f ? 1.f / running_sum : 0.f;  // no visible key: zeros
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) acc[e] *= inv_sum;
  store_from_float(static_cast<float*>(p.out) + (static_cast<int64_t>(token) * p.num_heads + head) * kHeadDim + lane_dim,
                   acc);
}

}  // namespace simt

// Launches the float32 kernel over every token of the batch.
template <int kHeadDim, int kBlockSize>
void launch_attention_f32(const PagedAttentionParams& p, cudaStream_t stream) {
  const int64_t warps = static_cast<int64_t>(p.num_tokens) * p.num_heads;
  const auto blocks = static_cast<unsigned>(ceil_div<int64_t>(warps, simt::kWarpsPerBlock));
  simt::attention_f32_kernel<kHeadDim, kBlockSize><<<blocks, simt::kWarpsPerBlock * 32, 0, stream>>>(p);
  check_launch("attention_f32_kernel");
}

}  // namespace pagedserve::cuda
