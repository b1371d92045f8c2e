// Decode paged attention (rows with one query; float16 / bfloat16):
// flash-decoding with split-K partitions and a reduction kernel.
//
// decode_partition_kernel, grid (partition, kv head x head chunk, row in
// p.decode_order, longest context first, when the grid queues for the SMs):
//   A CTA owns one partition (256..16384 tokens) of one row's context for the
//   query heads that share one kv head (up to 16 per CTA: the M of
//   mma.m16n8k16, zero-padded for smaller groups), so every K/V tile is read
//   from HBM once per GQA group. The partition streams through shared memory
//   in chunks of 64 tokens with a 3-stage cp.async pipeline; a chunk is whole
//   (block, kv head) tiles, B x D contiguous values each, gathered through the
//   block table with coalesced 16-byte copies. Per chunk, each of the 4 warps
//   scores 16 of its tokens; the warps exchange tile maxima and then the
//   probabilities through shared memory, and each warp accumulates P V for its
//   quarter of the head dim over all 64 tokens, in token order. So each row
//   sum and each output element is one chain over 64-token tiles, rounded as
//   cuDNN's decode attention (torch SDPA on Hopper) rounds it: a partition's
//   result is bit-identical to SDPA's up to 256 tokens
//   (bench/numerics/softmax_numerics.py), which is why partitions are not cut shorter.
//   Rows whose context fits one partition write `out` directly; others leave
//   O / l, m and l per partition in the workspace. With a sliding window a
//   row's partitions cover only its window [seq_len - W, seq_len): the grid
//   is sized from min(max_seq_len, W) and no key before the window is read.
//   Soft-capping maps the scores (ScoreMap) before the softmax.
// decode_reduce_kernel (decode_reduce.cuh), one warp per (row, query head):
//   merges the live partitions.
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
#include "decode_reduce.cuh"
#include "dependent_launch.cuh"
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
// The launch bound's CTAs an SM, which the plan counts as resident: D 128's ~105 KB of shared memory
// allows two (D 64's ~53 KB would allow more; the plan still counts two).
inline constexpr int kCtasPerSm = 2;

// CTAs along the grid's y for each kv head: its query heads, kHeadsPerCta at a time.
__host__ __device__ inline int head_chunks(const PagedAttentionParams& p) {
  return (p.num_heads / p.num_kv_heads + kHeadsPerCta - 1) / kHeadsPerCta;
}
// A plan's partitions (paged_attention.cu, plan_partition_tokens): the whole
// context (up to kLongestPartitionTokens) where the rows alone fill the card,
// halved while the grid has fewer than two CTAs an SM, down to
// kMinPartitionTokens; the fixed split (batch invariance) always cuts
// kFixedPartitionTokens, which also sizes the workspace's worst case.
inline constexpr int kFixedPartitionTokens = 512;
inline constexpr int kLongestPartitionTokens = 16384;
inline constexpr int kMinPartitionTokens = 256;  // shorter contexts stay one chain (see above)
inline constexpr int kProbStride = kChunkTokens + 8;  // floats per probability row: spreads rows over banks

template <typename T, int kHeadDim>
struct SharedLayout {
  static constexpr int kTileElems = kChunkTokens * kHeadDim;
  static constexpr int kQueryBytes = kHeadsPerCta * kHeadDim * static_cast<int>(sizeof(T));
  static constexpr int kStageBytes = 2 * kTileElems * static_cast<int>(sizeof(T));  // keys, then values
  static constexpr int kChunkMaxBytes = kWarps * kHeadsPerCta * 4;                  // the per-chunk max exchange
  static constexpr int kProbBytes = kHeadsPerCta * kProbStride * 4;                 // the chunk's probabilities
  static constexpr int kBytes = kQueryBytes + kStages * kStageBytes + kChunkMaxBytes + kProbBytes;
  static_assert(kQueryBytes % 16 == 0 && kStageBytes % 16 == 0, "tiles stay 16-byte aligned");
};

// One warp's online-softmax state: rows g and g + 8 (lane = 4 g + q) of the
// CTA's heads, and the output columns this warp owns.
template <int kHeadDim>
struct DecodeWarpState {
  static constexpr int kColumns = kHeadDim / kWarps;
  float max[2] = {-INFINITY, -INFINITY};
  float sum[2] = {0.f, 0.f};           // this lane's share until the quad sums it
  float out[kColumns / 8][4] = {};     // C fragment per 8 output columns
};

// The query heads a CTA serves: [first, first + count) of one kv head's group.
struct HeadRange {
  int kv_head;
  int first;
  int count;
};

__device__ __forceinline__ HeadRange cta_heads(const PagedAttentionParams& p) {
  const int group_size = p.num_heads / p.num_kv_heads;
  const int chunks = head_chunks(p);
  const int kv_head = static_cast<int>(blockIdx.y) / chunks;
  const int first = kv_head * group_size + static_cast<int>(blockIdx.y) % chunks * kHeadsPerCta;
  return {kv_head, first, min(kHeadsPerCta, (kv_head + 1) * group_size - first)};
}

// Writes this warp's columns of the CTA's rows: to `out` when this partition is
// the row's only one, else O / l, m and l to the workspace.
template <typename T, int kHeadDim>
__device__ __forceinline__ void store_partition(DecodeWarpState<kHeadDim>& state, const PagedAttentionParams& p,
                                                const DecodeSplit& split, const HeadRange& heads, int row, int token,
                                                int partition, bool only_partition, int warp, int lane) {
  constexpr int kColumns = DecodeWarpState<kHeadDim>::kColumns;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float l = quad_sum(state.sum[half]);  // >= 1: the max token contributes exp2(0)
    const int r = lane / 4 + 8 * half;
    if (r >= heads.count) continue;
    const int head = heads.first + r;
    const float inv_l = approx_reciprocal_or_zero(l);
    const int64_t slot = (static_cast<int64_t>(row) * p.num_heads + head) * split.num_partitions + partition;
    const int first_col = warp * kColumns + 2 * (lane % 4);
#pragma unroll
    for (int d = 0; d < kColumns / 8; ++d) {
      const float pair[2] = {state.out[d][2 * half] * inv_l, state.out[d][2 * half + 1] * inv_l};
      const int col = first_col + 8 * d;
      if (only_partition) {
        store_from_float(static_cast<T*>(p.out) + (static_cast<int64_t>(token) * p.num_heads + head) * kHeadDim + col,
                         pair);
      } else {
        store_from_float(split.partial_out + slot * kHeadDim + col, pair);
      }
    }
    if (!only_partition && warp == 0 && lane % 4 == 0) {
      split.partial_max[slot] = state.max[half];
      split.partial_sum[slot] = l;
    }
  }
}

// One 64-token chunk for the warp's rows: scores of its 16 tokens, the
// chunk's max from all warps, probabilities shared through shared memory, then
// the row sums and P V for the warp's columns over all 64 tokens in order.
template <typename T, int kHeadDim, typename Masked>
__device__ __forceinline__ void attend_chunk(DecodeWarpState<kHeadDim>& state, const uint32_t (&q)[kHeadDim / 16][4],
                                             const T* keys, const T* values, const ScoreMap& score, float* chunk_max,
                                             float* probs, int warp, int lane, Masked masked) {
  using Tile = SwizzledTile<kHeadDim>;
  constexpr int kColumns = DecodeWarpState<kHeadDim>::kColumns;
  const int g = lane / 4;
  const int q2 = 2 * (lane % 4);
  float s[kWarpTokens / 8][4];
  warp_scores<T, kHeadDim, kWarpTokens>(s, q, keys + warp * kWarpTokens * kHeadDim, score, lane, masked);
  float tile_max[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float m0 = fmaxf(s[0][2 * half], s[0][2 * half + 1]);
    tile_max[half] = quad_max(fmaxf(m0, fmaxf(s[1][2 * half], s[1][2 * half + 1])));
  }
  // Written after this chunk's first barrier, read before its last: one buffer is enough.
  if (lane % 4 == 0) {
    chunk_max[warp * kHeadsPerCta + g] = tile_max[0];
    chunk_max[warp * kHeadsPerCta + g + 8] = tile_max[1];
  }
  __syncthreads();
  float rescale[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float m = state.max[half];
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, chunk_max[w * kHeadsPerCta + g + 8 * half]);
    rescale[half] = exp2_shifted(state.max[half], m);
    state.max[half] = m;
  }
#pragma unroll
  for (int n = 0; n < kWarpTokens / 8; ++n) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float m = state.max[half];
      *reinterpret_cast<float2*>(probs + (g + 8 * half) * kProbStride + warp * kWarpTokens + 8 * n + q2) =
          make_float2(exp2_shifted(s[n][2 * half], m), exp2_shifted(s[n][2 * half + 1], m));
    }
  }
  __syncthreads();

  // This lane's probabilities of the whole chunk: tokens 8i + q2 and 8i + q2 + 1 of rows g and g + 8.
  float2 p[2][kChunkTokens / 8];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float tile_sum = 0.f;
#pragma unroll
    for (int i = 0; i < kChunkTokens / 8; ++i) {
      p[half][i] = *reinterpret_cast<const float2*>(probs + (g + 8 * half) * kProbStride + 8 * i + q2);
      tile_sum = (tile_sum + p[half][i].x) + p[half][i].y;
    }
    state.sum[half] = state.sum[half] * rescale[half] + tile_sum;
#pragma unroll
    for (int d = 0; d < kColumns / 8; ++d) {
      state.out[d][2 * half] *= rescale[half];
      state.out[d][2 * half + 1] *= rescale[half];
    }
  }
#pragma unroll
  for (int ks = 0; ks < kChunkTokens / 16; ++ks) {
    const uint32_t a[4] = {pack2<T>(p[0][2 * ks].x, p[0][2 * ks].y), pack2<T>(p[1][2 * ks].x, p[1][2 * ks].y),
                           pack2<T>(p[0][2 * ks + 1].x, p[0][2 * ks + 1].y),
                           pack2<T>(p[1][2 * ks + 1].x, p[1][2 * ks + 1].y)};
#pragma unroll
    for (int j = 0; j < kColumns / 16; ++j) {
      uint32_t b[4];
      const int slice = warp * (kColumns / 16) + j;  // 16-column slice of the head dim
      ldmatrix_x4_trans(b, values + Tile::offset(ks * 16 + lane % 16, 2 * slice + lane / 16));
      mma_m16n8k16<T>(state.out[2 * j], a, b[0], b[1]);
      mma_m16n8k16<T>(state.out[2 * j + 1], a, b[2], b[3]);
    }
  }
}

template <typename T, int kHeadDim, int kBlockSize>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    decode_partition_kernel(const PagedAttentionParams p, const DecodeSplit split) {
  using Layout = SharedLayout<T, kHeadDim>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* query_tile = reinterpret_cast<T*>(shared_bytes);
  T* stages = reinterpret_cast<T*>(shared_bytes + Layout::kQueryBytes);
  float* chunk_max = reinterpret_cast<float*>(shared_bytes + Layout::kQueryBytes + kStages * Layout::kStageBytes);
  float* probs = chunk_max + kWarps * kHeadsPerCta;

  // The step's index arrays come from the host's copy, complete before the step's first kernel (the op's
  // contract, cuda_ops.h): read them while the kernel before finishes. After the wait, the launch order's
  // extra dependent load cost the TinyLlama-shaped single stream 1.4 % tok/s (H200, measured before grids
  // of one wave stopped reading the order).
  const int row = p.decode_order == nullptr ? static_cast<int>(blockIdx.z) : p.decode_order[blockIdx.z];
  const bool row_ok = row >= 0 && row < p.num_decodes;  // a malformed order's entry is skipped
  const int seq_len = row_ok ? p.seq_lens[row] : 0;
  const int token = row_ok ? p.query_start_loc[row] : 0;
  wait_for_previous_kernel();  // launched dependent: the query and this step's keys come from kernels before
  let_next_kernel_launch();
  if (!row_ok) return;
  const int partition = static_cast<int>(blockIdx.x);
  const HeadRange heads = cta_heads(p);
  const int num_live = live_partitions(seq_len, p.window_span, split.partition_tokens, split.num_partitions);
  const int tid = static_cast<int>(threadIdx.x);
  if (num_live == 0) {  // an empty context (padding row): defined output, no reads
    if (partition != 0) return;
    T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(token) * p.num_heads + heads.first) * kHeadDim;
    for (int i = tid; i < heads.count * kHeadDim; i += kThreads) out[i] = from_float<T>(0.f);
    return;
  }
  if (partition >= num_live) return;

  const int start = decode_begin(seq_len, p.window_span) + partition * split.partition_tokens;
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
  const ScoreMap score = ScoreMap::make(p.scale, p.softcap);
  uint32_t q_frag[kHeadDim / 16][4];
  DecodeWarpState<kHeadDim> state;
  for (int chunk = 0; chunk < num_chunks; ++chunk) {
    cp_async_wait<kStages - 2>();  // this chunk (and the query) landed for this thread...
    __syncthreads();               // ...and for all; everyone is done with the stage reloaded next
    if (chunk == 0) load_query_fragments<T, kHeadDim>(q_frag, query_tile, lane);
    if (chunk + kStages - 1 < num_chunks) load_chunk(chunk + kStages - 1);
    cp_async_commit();
    // Every warp takes part (a warp past `end` sees only masked, zero-filled
    // keys) because the exchanges synchronize the CTA.
    const int first = start + chunk * kChunkTokens + warp * kWarpTokens;
    attend_chunk<T, kHeadDim>(state, q_frag, key_tile(chunk), value_tile(chunk), score, chunk_max, probs, warp,
                              lane, [&](int /*row*/, int key) { return first + key >= end; });
  }
  cp_async_wait<0>();
  store_partition<T, kHeadDim>(state, p, split, heads, row, token, partition, num_live == 1, warp, lane);
}

}  // namespace decode

// Launches the decode kernels for rows [0, p.num_decodes) with the given split.
template <typename T, int kHeadDim, int kBlockSize>
void launch_decode_attention(const PagedAttentionParams& p, const DecodeSplit& split, cudaStream_t stream) {
  using Layout = decode::SharedLayout<T, kHeadDim>;
  const dim3 grid(static_cast<unsigned>(split.num_partitions),
                  static_cast<unsigned>(p.num_kv_heads * decode::head_chunks(p)), static_cast<unsigned>(p.num_decodes));
  auto* kernel = decode::decode_partition_kernel<T, kHeadDim, kBlockSize>;
  allow_dynamic_smem(kernel, Layout::kBytes, "decode_partition_kernel");
  launch_dependent(kernel, grid, dim3(decode::kThreads), Layout::kBytes, stream, "decode_partition_kernel", p, split);
  if (split.num_partitions > 1) {
    const int blocks = ceil_div(p.num_decodes * p.num_heads, decode::kReduceWarpsPerBlock);
    launch_dependent(decode::decode_reduce_kernel<T, kHeadDim>, dim3(blocks), dim3(decode::kReduceWarpsPerBlock * 32),
                     0, stream, "decode_reduce_kernel", p, split);
  }
}

}  // namespace pagedserve::cuda
