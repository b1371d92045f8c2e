// Decode paged attention (rows with one query; float16 / bfloat16):
// flash-decoding with split-K partitions and a reduction kernel.
//
// decode_partition_kernel, grid (partition, kv head x head chunk, row):
//   A CTA owns one partition (64..512 tokens) of one row's context for the
//   query heads that share one kv head (up to 16 per CTA: the M of
//   mma.m16n8k16, zero-padded for smaller groups), so every K/V tile is read
//   from HBM once per GQA group. The partition streams through shared memory
//   in chunks of 64 tokens with a 3-stage cp.async pipeline; a chunk is whole
//   (block, kv head) tiles, B x D contiguous values each, gathered through the
//   block table with coalesced 16-byte copies. Each of the 4 warps runs the
//   online softmax over its 16 tokens of every chunk (warp_attention.cuh),
//   against the running max of whole chunks: the warps exchange their tile
//   maxima through shared memory before exponentiating, so probabilities are
//   rounded exactly as a FlashAttention-2 / cuDNN kernel with 64-token key
//   tiles rounds them (a partition's result is bit-identical to torch SDPA's
//   on Hopper up to 256 tokens; bench/sdpa_numerics.py). At the end the warps
//   merge (l, O) through shared memory.
//   Rows whose context fits one partition write `out` directly; others leave
//   O / l, m and l per partition in the workspace.
// decode_reduce_kernel, one warp per (row, query head): merges the live
//   partitions (it reads seq_lens: the grid was sized from max_seq_len).
//
// Numbers for 64 rows x 4096 tokens, 32 q / 8 kv heads, D 128, bf16:
//   K + V read once: 64 * 4096 * 8 * 128 * 2 B * 2 = 1.07 GB; grid 8 x 8 x 64
//   = 4096 CTAs of 256 KB each; partials 64 * 32 * 8 * (128 + 2) * 4 B =
//   8.5 MB written and re-read (< 1 %); 4.3 GFLOP of real work (17 GFLOP
//   issued with the 16-row padding: ~2 % of the tensor-core time available).
//   Bandwidth bound: ~0.35 ms at 3 TB/s.
#pragma once

#include <cstdint>

#include "attention_common.cuh"
#include "attention_params.h"
#include "cuda_check.h"
#include "float_convert.cuh"
#include "mma.cuh"
#include "smem_tile.cuh"
#include "warp_attention.cuh"

namespace pagedserve::cuda {
namespace decode {

inline constexpr int kWarps = 4;
inline constexpr int kThreads = kWarps * 32;
inline constexpr int kHeadsPerCta = 16;  // mma M
inline constexpr int kWarpTokens = 16;   // one k-step of P V per warp and chunk
inline constexpr int kChunkTokens = kWarps * kWarpTokens;
inline constexpr int kStages = 3;
inline constexpr int kMaxPartitionTokens = 512;
inline constexpr int kMinPartitionTokens = 64;
inline constexpr int kSlabPad = 8;  // floats per merge-slab row: spreads rows over banks
inline constexpr int kReduceWarpsPerBlock = 4;

template <typename T, int kHeadDim>
struct SharedLayout {
  static constexpr int kTileElems = kChunkTokens * kHeadDim;
  static constexpr int kQueryBytes = kHeadsPerCta * kHeadDim * static_cast<int>(sizeof(T));
  static constexpr int kStageBytes = 2 * kTileElems * static_cast<int>(sizeof(T));  // keys, then values
  static constexpr int kChunkMaxBytes = kWarps * kHeadsPerCta * 4;  // the per-chunk max exchange
  static constexpr int kBytes = kQueryBytes + kStages * kStageBytes + kChunkMaxBytes;
  // After the main loop the stage area holds the warp merge: max and sum per
  // (warp, row), then each warp's rescaled O.
  static constexpr int kSlabRowFloats = kHeadDim + kSlabPad;
  static constexpr int kMergeFloats = 2 * kWarps * kHeadsPerCta + kWarps * kHeadsPerCta * kSlabRowFloats;
  static_assert(kMergeFloats * 4 <= kStages * kStageBytes, "the merge must fit in the stage area");
  static_assert(kQueryBytes % 16 == 0 && kStageBytes % 16 == 0, "tiles stay 16-byte aligned");
};

// The query heads a CTA serves: [first, first + count) of one kv head's group.
struct HeadRange {
  int kv_head;
  int first;
  int count;
};

__device__ __forceinline__ HeadRange cta_heads(const PagedAttentionParams& p) {
  const int group_size = p.num_heads / p.num_kv_heads;
  const int chunks = (group_size + kHeadsPerCta - 1) / kHeadsPerCta;
  const int kv_head = static_cast<int>(blockIdx.y) / chunks;
  const int first = kv_head * group_size + static_cast<int>(blockIdx.y) % chunks * kHeadsPerCta;
  return {kv_head, first, min(kHeadsPerCta, (kv_head + 1) * group_size - first)};
}

// Merges the 4 warps' softmax states and writes the CTA's rows: to `out`
// when this partition is the row's only one, else to the workspace.
template <typename T, int kHeadDim>
__device__ __forceinline__ void merge_warps_and_store(WarpAttentionState<kHeadDim>& state, float* merge,
                                                      const PagedAttentionParams& p, const DecodeSplit& split,
                                                      const HeadRange& heads, int row, int token, int partition,
                                                      bool only_partition) {
  using Layout = SharedLayout<T, kHeadDim>;
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32;
  const int lane = tid % 32;
  float* row_maxes = merge;                        // [kWarps][16] per-warp row max
  float* row_sums = merge + kWarps * kHeadsPerCta;  // [kWarps][16] per-warp row sum
  float* slab = merge + 2 * kWarps * kHeadsPerCta;        // [kWarps][16][kSlabRowFloats]
  state.finish_sums();
  const int g = lane / 4;
  if (lane % 4 == 0) {
    for (int half = 0; half < 2; ++half) {
      row_maxes[warp * kHeadsPerCta + g + 8 * half] = state.max[half];
      row_sums[warp * kHeadsPerCta + g + 8 * half] = state.sum[half];
    }
  }
  __syncthreads();

  auto row_max = [&](int r) {
    float m = row_maxes[r];
    for (int w = 1; w < kWarps; ++w) m = fmaxf(m, row_maxes[w * kHeadsPerCta + r]);
    return m;  // finite: warp 0 always saw the partition's first token
  };
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = g + 8 * half;
    const float factor = exp2f(state.max[half] - row_max(r));  // 0 for a warp that saw no token
    float* dst = slab + (warp * kHeadsPerCta + r) * Layout::kSlabRowFloats + 2 * (lane % 4);
#pragma unroll
    for (int d = 0; d < kHeadDim / 8; ++d) {
      *reinterpret_cast<float2*>(dst + 8 * d) =
          make_float2(state.out[d][2 * half] * factor, state.out[d][2 * half + 1] * factor);
    }
  }
  __syncthreads();

  constexpr int kChunksPerRow = kHeadDim / 8;
  for (int item = tid; item < kHeadsPerCta * kChunksPerRow; item += kThreads) {
    const int r = item / kChunksPerRow;
    const int col = item % kChunksPerRow * 8;
    if (r >= heads.count) continue;
    const float m = row_max(r);
    float l = 0.f;
    float acc[8] = {};
    for (int w = 0; w < kWarps; ++w) {
      l += row_sums[w * kHeadsPerCta + r] * exp2f(row_maxes[w * kHeadsPerCta + r] - m);
      const float* src = slab + (w * kHeadsPerCta + r) * Layout::kSlabRowFloats + col;
      float part[8];
      load_as_float(part, src);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += part[i];
    }
    const float inv_l = 1.f / l;  // l >= 1: the max token contributes exp2(0)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] *= inv_l;
    const int head = heads.first + r;
    if (only_partition) {
      T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(token) * p.num_heads + head) * kHeadDim + col;
      store_from_float(out, acc);
    } else {
      const int64_t slot = (static_cast<int64_t>(row) * p.num_heads + head) * split.num_partitions + partition;
      store_from_float(split.partial_out + slot * kHeadDim + col, acc);
      if (col == 0) {
        split.partial_max[slot] = m;
        split.partial_sum[slot] = l;
      }
    }
  }
}

template <typename T, int kHeadDim, int kBlockSize>
__global__ void __launch_bounds__(kThreads, 2)
    decode_partition_kernel(const PagedAttentionParams p, const DecodeSplit split) {
  using Layout = SharedLayout<T, kHeadDim>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* query_tile = reinterpret_cast<T*>(shared_bytes);
  T* stages = reinterpret_cast<T*>(shared_bytes + Layout::kQueryBytes);
  float* chunk_max = reinterpret_cast<float*>(shared_bytes + Layout::kQueryBytes + kStages * Layout::kStageBytes);

  const int row = static_cast<int>(blockIdx.z);
  const int partition = static_cast<int>(blockIdx.x);
  const HeadRange heads = cta_heads(p);
  const int seq_len = p.seq_lens[row];
  const int token = p.query_start_loc[row];
  const int num_live = live_partitions(seq_len, split.partition_tokens, split.num_partitions);
  const int tid = static_cast<int>(threadIdx.x);
  if (num_live == 0) {  // an empty context (padding row): defined output, no reads
    if (partition != 0) return;
    T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(token) * p.num_heads + heads.first) * kHeadDim;
    for (int i = tid; i < heads.count * kHeadDim; i += kThreads) out[i] = from_float<T>(0.f);
    return;
  }
  if (partition >= num_live) return;

  const int start = partition * split.partition_tokens;
  const int end = min(start + split.partition_tokens, seq_len);
  const int num_chunks = (end - start + kChunkTokens - 1) / kChunkTokens;
  const int32_t* block_table = p.block_tables + static_cast<int64_t>(row) * p.max_blocks_per_seq;
  const T* key_cache = static_cast<const T*>(p.key_cache);
  const T* value_cache = static_cast<const T*>(p.value_cache);
  auto key_tile = [&](int chunk) { return stages + chunk % kStages * 2 * Layout::kTileElems; };
  auto value_tile = [&](int chunk) { return key_tile(chunk) + Layout::kTileElems; };
  auto load_chunk = [&](int chunk) {
    load_kv_tiles_async<T, kHeadDim, kBlockSize, kChunkTokens, kThreads>(
        key_tile(chunk), value_tile(chunk), key_cache, value_cache, block_table, start + chunk * kChunkTokens, end,
        heads.kv_head, p.num_kv_heads, tid);
  };

  const T* query = static_cast<const T*>(p.query) + (static_cast<int64_t>(token) * p.num_heads + heads.first) * kHeadDim;
  load_rows_async<T, kHeadDim, kHeadsPerCta, kThreads>(query_tile, query, kHeadDim, heads.count, tid);
#pragma unroll
  for (int chunk = 0; chunk < kStages - 1; ++chunk) {
    if (chunk < num_chunks) load_chunk(chunk);
    cp_async_commit();  // one group per chunk slot, empty or not, keeps the wait counts uniform
  }

  const int warp = tid / 32;
  const int lane = tid % 32;
  const float scale_log2 = p.scale * kLog2e;
  uint32_t q_frag[kHeadDim / 16][4];
  WarpAttentionState<kHeadDim> state;
  for (int chunk = 0; chunk < num_chunks; ++chunk) {
    cp_async_wait<kStages - 2>();  // this chunk (and the query) landed for this thread...
    __syncthreads();               // ...and for all; everyone is done with the stage reloaded next
    if (chunk == 0) load_query_fragments<T, kHeadDim>(q_frag, query_tile, lane);
    if (chunk + kStages - 1 < num_chunks) load_chunk(chunk + kStages - 1);
    cp_async_commit();
    // Every warp takes part (a warp past `end` sees only masked, zero-filled
    // keys) because the max exchange synchronizes the CTA.
    const int first = start + chunk * kChunkTokens + warp * kWarpTokens;
    const int offset = warp * kWarpTokens * kHeadDim;
    warp_attend<T, kHeadDim, kWarpTokens>(
        state, q_frag, key_tile(chunk) + offset, value_tile(chunk) + offset, scale_log2, lane,
        [&](int /*row*/, int key) { return first + key >= end; },
        [&](float (&tile_max)[2]) {
          // Written after this chunk's first barrier, read before the next chunk's: one buffer is enough.
          const int g = lane / 4;
          if (lane % 4 == 0) {
            chunk_max[warp * kHeadsPerCta + g] = tile_max[0];
            chunk_max[warp * kHeadsPerCta + g + 8] = tile_max[1];
          }
          __syncthreads();
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            float m = -INFINITY;
#pragma unroll
            for (int w = 0; w < kWarps; ++w) m = fmaxf(m, chunk_max[w * kHeadsPerCta + g + 8 * half]);
            tile_max[half] = m;
          }
        });
  }
  cp_async_wait<0>();
  __syncthreads();  // the stage area becomes the merge area
  merge_warps_and_store<T, kHeadDim>(state, reinterpret_cast<float*>(stages), p, split, heads, row, token, partition,
                                     num_live == 1);
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kReduceWarpsPerBlock * 32)
    decode_reduce_kernel(const PagedAttentionParams p, const DecodeSplit split) {
  constexpr int kPerLane = kHeadDim / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp_index = static_cast<int>(blockIdx.x) * kReduceWarpsPerBlock + static_cast<int>(threadIdx.x) / 32;
  const int row = warp_index / p.num_heads;
  const int head = warp_index % p.num_heads;
  if (row >= p.num_decodes) return;
  const int num_live = live_partitions(p.seq_lens[row], split.partition_tokens, split.num_partitions);
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

// Launches the decode kernels for rows [0, p.num_decodes) with the given split.
template <typename T, int kHeadDim, int kBlockSize>
void launch_decode_attention(const PagedAttentionParams& p, const DecodeSplit& split, cudaStream_t stream) {
  using Layout = decode::SharedLayout<T, kHeadDim>;
  const int group_size = p.num_heads / p.num_kv_heads;
  const int head_chunks = ceil_div(group_size, decode::kHeadsPerCta);
  const dim3 grid(static_cast<unsigned>(split.num_partitions), static_cast<unsigned>(p.num_kv_heads * head_chunks),
                  static_cast<unsigned>(p.num_decodes));
  auto* kernel = decode::decode_partition_kernel<T, kHeadDim, kBlockSize>;
  allow_dynamic_smem(kernel, Layout::kBytes, "decode_partition_kernel");
  kernel<<<grid, decode::kThreads, Layout::kBytes, stream>>>(p, split);
  check_launch("decode_partition_kernel");
  if (split.num_partitions > 1) {
    const int blocks = ceil_div(p.num_decodes * p.num_heads, decode::kReduceWarpsPerBlock);
    decode::decode_reduce_kernel<T, kHeadDim><<<blocks, decode::kReduceWarpsPerBlock * 32, 0, stream>>>(p, split);
    check_launch("decode_reduce_kernel");
  }
}

}  // namespace pagedserve::cuda
