// Prefill / extend paged attention for head dim 128 on Hopper's warpgroup MMA
// (wgmma, sm_90a; float16 / bfloat16). The grid, the causal / window masks,
// soft-capping and the online softmax (warp_attention.cuh) are the mma.sync
// kernel's (prefill_attention.cuh), which runs where wgmma is not built or not
// on the card; this one runs every head-dim-128 prefill row on an H100 / H200,
// whatever the batch, so a row's arithmetic never depends on its batch.
//
// A CTA owns 128 query tokens of one head of one row: two warpgroups of 64
// rows. Keys and values stream in 128-token tiles through three stages of
// shared memory in the 128-byte-swizzled layout wgmma reads (SlabTile). Per
// tile a warpgroup computes S = Q K^T (64 x 128, eight k-steps reading Q and
// K from shared memory), runs the softmax on its registers (each warp on its
// 16 rows), and adds P V (P from registers, V as an MN-major operand).
//
// Three overlaps make it fast; the arithmetic is the same either way:
//  - P V of tile t is issued with Q K^T of tile t + 1, so the tensor cores
//    work on it while the warpgroup waits for the scores and starts their
//    softmax (O is rescaled once it lands);
//  - the warpgroups take turns issuing (named barriers), so one's softmax
//    runs while the other's products keep the tensor cores busy;
//  - no __syncthreads a tile: a stage is handed over by mbarriers (full:
//    every thread's cp.async copies landed; empty: every thread's reads of it
//    done), so the warpgroups run half a tile apart.
// Every thread copies its share of every tile, and both warpgroups run every
// tile of the CTA (a tile wholly masked for a warpgroup's rows adds exact
// zeros), so both take the same number of turns.
//
// Numbers (H200, one causal prompt of 4096 tokens, 32 / 8 heads, bf16;
// bench/perf/kernel_bench.py --prefill-only, bench/results/h200/session35.md):
// the mma.sync kernel 213-223 TFLOP/s (27-29 % of the matmul rate measured
// beside it); this kernel with S / softmax / P V in sequence 267-273, with
// P V beside the next Q K^T 255-278, with the mbarrier hand-over and turns
// 325-334 (41-47 %). ncu of the second: tensor pipe ~32 % busy, 0.44
// eligible warps a scheduler; registers 255 a thread, no spills.
//
// Shared memory: query 32 KB + 3 stages x (32 KB keys + 32 KB values) + 6
// mbarriers + 1 KB to align the atoms = 225 KB (of 227), one CTA (8 warps)
// an SM.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attention_common.cuh"
#include "attention_params.h"
#include "cuda_check.h"
#include "device_features.h"
#include "mbarrier.cuh"
#include "prefill_tile.cuh"
#include "smem_tile.cuh"
#include "warp_attention.cuh"
#include "wgmma.cuh"

namespace pagedserve::cuda {
namespace prefill_wgmma {

inline constexpr int kHeadDim = 128;
inline constexpr int kKeys = 128;  // keys per K / V tile: the N of Q K^T
inline constexpr int kGroups = 2;  // warpgroups a CTA
inline constexpr int kQueryRows = kGroups * wgmma::kRows;
inline constexpr int kThreads = kGroups * wgmma::kGroupThreads;
inline constexpr int kIssueTurn = 1;  // named barriers 1, 2: a warpgroup's turn to issue
inline constexpr int kStages = 3;  // values of tile t - 1 (P V), keys of t (Q K^T), t + 1 loading

using QueryTile = SlabTile<kHeadDim, kQueryRows>;
using KvTile = SlabTile<kHeadDim, kKeys>;

template <typename T>
struct SharedLayout {
  static constexpr int kQueryBytes = kQueryRows * kHeadDim * static_cast<int>(sizeof(T));
  static constexpr int kTileElems = kKeys * kHeadDim;
  static constexpr int kTileBytes = kTileElems * static_cast<int>(sizeof(T));
  static constexpr int kStageBytes = 2 * kTileBytes;  // keys, then values
  static constexpr int kSlabBytes = kKeys * wgmma::kSwizzleRowBytes;
  static constexpr int kBarrierOffset = kQueryBytes + kStages * kStageBytes;  // full[kStages], empty[kStages]
  static constexpr int kBytes = kBarrierOffset + 2 * kStages * 8 + wgmma::kAtomBytes;  // + alignment slack
  static_assert(kQueryBytes % wgmma::kAtomBytes == 0 && kTileBytes % wgmma::kAtomBytes == 0, "atoms stay aligned");
};

// Issues S = Q K^T for the warpgroup's 64 rows against the tile's 128 keys
// (eight k-steps, one commit group): s[n] becomes the C fragment of keys
// [8 n, 8 n + 8) of the warp's 16 rows once the group completes.
template <typename T>
__device__ __forceinline__ void issue_scores(float (&s)[kKeys / 8][4], uint64_t query, uint64_t keys) {
  float (&d)[64] = reinterpret_cast<float (&)[64]>(s);
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    // 16 values = 32 bytes a k-step inside a slab's 128-byte rows; 64 values on, the next slab.
    const uint32_t query_step = (ks / 4) * QueryTile::kSlabElems * 2 + (ks % 4) * 32;
    const uint32_t key_step = (ks / 4) * KvTile::kSlabElems * 2 + (ks % 4) * 32;
    wgmma::mma_128_ss<T>(d, wgmma::advance(query, query_step), wgmma::advance(keys, key_step), ks > 0);
  }
  wgmma::commit_group();
}

// Issues O += P V (one commit group): the warp's probabilities (16 rows x 128
// keys) as eight A fragments against the value tile, 16 keys (2 KB of slab
// rows) a k-step.
template <typename T>
__device__ __forceinline__ void issue_values(WarpAttentionState<kHeadDim>& state, const uint32_t (&p)[kKeys / 16][4],
                                             uint64_t values) {
  float (&d)[64] = reinterpret_cast<float (&)[64]>(state.out);
#pragma unroll
  for (int slice = 0; slice < kKeys / 16; ++slice) {
    wgmma::mma_128_rs_mn<T>(d, p[slice], wgmma::advance(values, slice * 16 * wgmma::kSwizzleRowBytes));
  }
  wgmma::commit_group();
}

template <typename T, int kBlockSize>
__global__ void __launch_bounds__(kThreads, 1) prefill_attention_wgmma_kernel(const PagedAttentionParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)
  using Layout = SharedLayout<T>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  // The swizzle atoms need 1,024-byte aligned shared addresses.
  const uint32_t misalignment = shared_address(shared_bytes) % wgmma::kAtomBytes;
  unsigned char* aligned = shared_bytes + (misalignment == 0 ? 0 : wgmma::kAtomBytes - misalignment);
  T* query_tile = reinterpret_cast<T*>(aligned);
  T* stages = reinterpret_cast<T*>(aligned + Layout::kQueryBytes);

  const int head = static_cast<int>(blockIdx.y);
  PrefillTile cta = PrefillTile::of_this_cta<kQueryRows>(p);
  if (cta.idle()) return;
  cta.find_keys<kQueryRows>(p);
  const int row = cta.row, q_begin = cta.q_begin, q_len = cta.q_len, m0 = cta.m0, seq_len = cta.seq_len;
  const int tile_first_pos = cta.first_pos, kv_begin = cta.kv_begin, kv_end = cta.kv_end;
  const int span = p.window_span;  // INT_MAX without a window
  const int num_tiles = cta.num_key_tiles<kKeys>();
  const int kv_head = head / (p.num_heads / p.num_kv_heads);

  const int tid = static_cast<int>(threadIdx.x);
  const int64_t token_stride = static_cast<int64_t>(p.num_heads) * kHeadDim;
  const T* query = static_cast<const T*>(p.query) + (q_begin + m0) * token_stride + head * kHeadDim;
  const int32_t* block_table = p.block_tables + static_cast<int64_t>(row) * p.max_blocks_per_seq;
  auto key_tile = [&](int tile) { return stages + tile % kStages * 2 * Layout::kTileElems; };
  auto value_tile = [&](int tile) { return key_tile(tile) + Layout::kTileElems; };
  auto load_tile = [&](int tile) {
    load_kv_tiles_async<T, kHeadDim, kBlockSize, kKeys, kThreads, KvTile>(
        key_tile(tile), value_tile(tile), static_cast<const T*>(p.key_cache), static_cast<const T*>(p.value_cache),
        block_table, kv_begin + tile * kKeys, kv_end, kv_head, p.num_kv_heads, tid);
  };

  // Stage s holds tiles s, s + kStages, ...: full[s] completes when every
  // thread's copies of its current tile landed, empty[s] when every thread is
  // done reading it (one arrival each per tile).
  uint64_t* full = reinterpret_cast<uint64_t*>(aligned + Layout::kBarrierOffset);
  uint64_t* empty = full + kStages;
  if (tid == 0) {
    for (int stage = 0; stage < kStages; ++stage) {
      mbarrier_init(full + stage, kThreads);
      mbarrier_init(empty + stage, kThreads);
    }
  }
  __syncthreads();
  // Tile t is the (t / kStages)-th fill of stage t % kStages; a wait names its phase by parity.
  auto wait_full = [&](int tile) { mbarrier_wait(full + tile % kStages, tile / kStages % 2); };
  auto refill = [&](int tile) {  // this thread's copies of `tile`, once its stage's previous tile is done with
    if (tile >= kStages) mbarrier_wait(empty + tile % kStages, (tile / kStages - 1) % 2);
    load_tile(tile);
    cp_async_arrive(full + tile % kStages);
  };
  load_rows_async<T, kHeadDim, kQueryRows, kThreads, QueryTile>(query_tile, query, token_stride,
                                                                min(q_len - m0, kQueryRows), tid);
  if (num_tiles > 0) refill(0);  // its arrival also covers the query's copies

  // Read through a shuffle, the warp (and warpgroup) index is warp-uniform to
  // the compiler, and so are the branches around the wgmmas: ptxas serializes
  // wgmmas it cannot prove the whole warpgroup reaches.
  const int warp = __shfl_sync(0xffffffffu, tid / 32, 0);
  const int lane = tid % 32;
  const int group = warp / 4;
  const int warp_first_pos = tile_first_pos + warp * kWarpQueryRows;
  const ScoreMap score = ScoreMap::make(p.scale, p.softcap);
  // The warpgroup's 64 query rows: K-major, 8 rows a 1,024-byte atom.
  const uint64_t query_desc = wgmma::descriptor(query_tile + group * wgmma::kRows * 64, 16, wgmma::kAtomBytes);
  auto key_desc = [&](int tile) { return wgmma::descriptor(key_tile(tile), 16, wgmma::kAtomBytes); };
  // V is MN-major: the leading stride is from one 64-column slab to the next.
  auto value_desc = [&](int tile) {
    return wgmma::descriptor(value_tile(tile), Layout::kSlabBytes, wgmma::kAtomBytes);
  };

  // The warpgroups take turns issuing their tile's wgmmas (named barrier
  // kIssueTurn + g: group g's turn), so one's softmax runs while the other's
  // products keep the tensor cores busy. Group 1 lets group 0 go first.
  auto wait_turn = [&] { named_barrier_sync(kIssueTurn + group, kThreads); };
  auto pass_turn = [&] { named_barrier_arrive(kIssueTurn + 1 - group, kThreads); };
  if (group == 1 && num_tiles > 0) pass_turn();

  // A tile's P V runs beside the next tile's Q K^T (and the first half of
  // its softmax): `probs` holds the previous tile's probabilities until then.
  // Before the first tile they are zeros against that tile's (finite)
  // values, which adds exact zeros to O and keeps the issue order branch-free.
  // Every warpgroup runs every tile of the CTA (a tile wholly masked for its
  // rows adds exact zeros), so both take the same number of turns.
  WarpAttentionState<kHeadDim> state;
  uint32_t probs[kKeys / 16][4] = {};
  for (int tile = 0; tile < num_tiles; ++tile) {
    wait_full(tile);                        // this tile (and, first, the query) landed for every thread,
    wgmma::fence_shared_for_async_proxy();  // and is visible to wgmma's reads
    float s[kKeys / 8][4];
    wait_turn();
    wgmma::fence();
    issue_scores<T>(s, query_desc, key_desc(tile));
    issue_values<T>(state, probs, value_desc(tile > 0 ? tile - 1 : tile));
    pass_turn();
    if (tile + 1 < num_tiles) refill(tile + 1);
    wgmma::wait_group<1>();  // the scores; P V may still run
    wgmma::pin(reinterpret_cast<float (&)[64]>(s));
    const int first_key = kv_begin + tile * kKeys;
    const bool full_tile =
        first_key + kKeys - 1 <= warp_first_pos && warp_first_pos + kWarpQueryRows - 1 - first_key < span;
    if (full_tile) {
      map_scores(s, score, lane, [](int, int) { return false; });
    } else {
      map_scores(s, score, lane, [&](int r, int key) {  // in the row's future, past the row, or before its window
        const int position = first_key + key;
        const int query_pos = warp_first_pos + r;
        return position > query_pos || position >= seq_len || query_pos - position >= span;
      });
    }
    float rescale[2];
    softmax_tile(state, s, rescale);
    wgmma::wait_group<0>();  // the previous tile's P V, before O is rescaled and its P replaced
    wgmma::pin(reinterpret_cast<float (&)[64]>(state.out));
#pragma unroll
    for (int slice = 0; slice < kKeys / 16; ++slice) wgmma::pin(probs[slice]);
    if (tile > 0) mbarrier_arrive(empty + (tile - 1) % kStages);  // its values were the last read of it
    rescale_output(state, rescale);
#pragma unroll
    for (int slice = 0; slice < kKeys / 16; ++slice) probability_fragment<T>(probs[slice], s, slice);
  }
  if (num_tiles > 0) {  // the last tile's P V, in turn (group 0 passes it on, to group 1's last wait)
    wait_turn();
    wgmma::fence();
    issue_values<T>(state, probs, value_desc(num_tiles - 1));
    if (group == 0) pass_turn();
    wgmma::wait_group<0>();
    wgmma::pin(reinterpret_cast<float (&)[64]>(state.out));
#pragma unroll
    for (int slice = 0; slice < kKeys / 16; ++slice) wgmma::pin(probs[slice]);
  }
  cp_async_wait<0>();  // every copy was waited for through `full`; this keeps it so should a row be malformed

  T* out = static_cast<T*>(p.out) + (q_begin + m0) * token_stride + head * kHeadDim;
  store_warp_rows<T, kHeadDim>(state, out, token_stride, warp * kWarpQueryRows, min(q_len - m0, kQueryRows), lane);
#else
  __trap();  // launched only where sm_90a code was built (available() below)
#endif
}

// Whether this build holds the sm_90a kernel and the current device runs it
// (compute capability 9.0), and PAGEDSERVE_WGMMA is not "0" (the mma.sync
// kernel instead, for A/B runs). Cached per device.
inline bool available() {
#if defined(PAGEDSERVE_WGMMA)
  static const bool allowed = env_switch_on("PAGEDSERVE_WGMMA");
  return allowed && current_compute_capability() == 90;
#else
  return false;
#endif
}

// Whether prefill rows of this head dim run this kernel here (the one rule
// launch_prefill_attention and prefill_attention_kernel follow).
inline bool takes(int head_dim) { return head_dim == kHeadDim && available(); }

}  // namespace prefill_wgmma

// Launches the wgmma kernel for rows [p.num_decodes, p.num_seqs).
template <typename T, int kBlockSize>
void launch_prefill_attention_wgmma(const PagedAttentionParams& p, cudaStream_t stream) {
  using namespace prefill_wgmma;
  const dim3 grid(static_cast<unsigned>(ceil_div(p.max_query_len, kQueryRows)), static_cast<unsigned>(p.num_heads),
                  static_cast<unsigned>(p.num_seqs - p.num_decodes));
  auto* kernel = prefill_attention_wgmma_kernel<T, kBlockSize>;
  allow_dynamic_smem(kernel, SharedLayout<T>::kBytes, "prefill_attention_wgmma_kernel");
  kernel<<<grid, kThreads, SharedLayout<T>::kBytes, stream>>>(p);
  check_launch("prefill_attention_wgmma_kernel");
}

}  // namespace pagedserve::cuda
