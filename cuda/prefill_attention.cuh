// Prefill / extend paged attention (rows with q_len > 1; float16 / bfloat16):
// FlashAttention-2 on mma.sync tensor cores, keys and values gathered from
// the paged cache. At head dim 128 on an H100 / H200 (sm_90a built) the wgmma
// kernel runs instead (prefill_attention_wgmma.cuh, launch_prefill_attention).
//
// Grid (query tile, query head, prefill row): a CTA owns 64 query tokens (128
// from kWideQueryLen on at head dim 128, WideShape) of one head of one row;
// CTAs of query tiles past the row's q_len exit at once, so no host-side tile
// list is needed (grid x comes from max_query_len). The heaviest (last) query
// tiles launch first to shorten the causal tail.
//
// Inside the CTA: warps of 16 query rows each. The query tile is copied once
// to shared memory and held as A fragments in registers; keys and values
// stream in tiles of Shape::kKeys through a double-buffered cp.async pipeline
// gathering whole (block, kv head) rows through the block table
// (smem_tile.cuh). Each warp computes S = Q K^T, the online softmax and
// O += P V in registers (warp_attention.cuh); key tiles are 128 tokens for
// head dim 64 (see DefaultShape). Causality: query i of the chunk sits at
// position seq_len - q_len + i (after the cached prefix); key tiles entirely
// in the future of a CTA are never loaded, tiles entirely in the past skip the
// mask, and a warp skips a tile in its own future. A sliding window W starts
// the key tiles at the CTA's first query's window (position - W + 1), so keys
// before every query's window are never loaded, and a warp skips tiles wholly
// before its own rows' windows. Soft-capping maps the scores (ScoreMap).
//
// Numbers for one 4096-token causal prompt, 32 q / 8 kv heads, D 128, bf16
// (WideShape):
//   4 * 4096^2 / 2 * 128 * 32 = 137 GFLOP useful (diagonal tiles add ~1.5 %);
//   1024 CTAs, each streaming on average 32 K/V tiles of 32 KB from L2
//   (1.1 GB of L2 traffic; HBM sees each kv head's 2 MB about once).
//   Shared memory: 32 KB query + 2 x 32 KB stages = 96 KB, one CTA per SM
//   (251 registers a thread). ncu on the H200: the tensor pipe is busy 36 % of
//   the time; a warp waits ~5.4 cycles between instructions, mostly on the
//   fixed latencies of its own dependent mma / softmax / mma phases, which
//   the other warp of its scheduler (in step with it, same CTA) cannot fill.
#pragma once

#include <cstdint>

#include "attention_common.cuh"
#include "attention_params.h"
#include "cuda_check.h"
#include "float_convert.cuh"
#include "mma.cuh"
#include "prefill_attention_wgmma.cuh"
#include "prefill_tile.cuh"
#include "smem_tile.cuh"
#include "warp_attention.cuh"

namespace pagedserve::cuda {
namespace prefill {

inline constexpr int kWarpRows = kWarpQueryRows;

// The shape of a CTA: warps (16 query rows each), keys per K / V tile,
// cp.async stages, and the CTAs an SM is to hold (__launch_bounds__'s
// register budget). bench/perf/probes/prefill_tiles.cu times candidates.
template <int kWarps_, int kKeys_, int kStages_, int kCtasPerSm_>
struct CtaShape {
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kQueryRows = kWarps * kWarpRows;
  static constexpr int kKeys = kKeys_;
  static constexpr int kStages = kStages_;
  static constexpr int kCtasPerSm = kCtasPerSm_;
  static_assert(kStages >= 2, "the pipeline overlaps the next tile's copy with this tile's math");
};

// Keys per tile: 128 for head dim 64, the tile torch SDPA's cuDNN kernel uses
// on Hopper there, so probabilities round at the same points and the output
// is bit-identical to it (bench/numerics/sdpa_numerics.py); 64 for larger heads, to
// keep two CTAs per SM.
template <int kHeadDim>
using DefaultShape = CtaShape<4, kHeadDim <= 64 ? 128 : 64, 2, 2>;

// Head dim 128 from kWideQueryLen query tokens: 8 warps (128 query rows) share
// each K / V tile, so a tile's cp.async address work serves twice the rows
// (~18 % fewer instructions); 1 CTA per SM keeps 8 warps an SM as before. H200,
// one causal prompt, 32 / 8 heads, bf16 (bench/results/h200/session32.md):
// 4096 tokens 218 -> 230 TFLOP/s, 2048 tokens +3 %, 1024 +0.5 % (short rows
// leave more of the wider CTA idle). Every row's arithmetic is the default
// shape's (same key tiles, same order), so a row's output does not depend on
// which shape its batch ran. The probe's other candidates were slower: two row
// tiles a warp (the query read from shared memory), 32-key tiles, 3 stages, or
// 12-16 warps an SM at 128-168 registers.
inline constexpr int kWideQueryLen = 2048;
using WideShape = CtaShape<8, 64, 2, 1>;

template <typename T, int kHeadDim, typename Shape>
struct SharedLayout {
  static constexpr int kQueryBytes = Shape::kQueryRows * kHeadDim * static_cast<int>(sizeof(T));
  static constexpr int kTileElems = Shape::kKeys * kHeadDim;
  static constexpr int kStageBytes = 2 * kTileElems * static_cast<int>(sizeof(T));  // keys, then values
  static constexpr int kBytes = kQueryBytes + Shape::kStages * kStageBytes;
  static_assert(kQueryBytes % 16 == 0 && kStageBytes % 16 == 0, "tiles stay 16-byte aligned");
};

template <typename T, int kHeadDim, int kBlockSize, typename Shape>
__global__ void __launch_bounds__(Shape::kThreads, Shape::kCtasPerSm) prefill_attention_kernel(const PagedAttentionParams p) {
  using Layout = SharedLayout<T, kHeadDim, Shape>;
  constexpr int kKeys = Shape::kKeys;
  constexpr int kQueryRows = Shape::kQueryRows;
  constexpr int kThreads = Shape::kThreads;
  constexpr int kStages = Shape::kStages;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* query_tile = reinterpret_cast<T*>(shared_bytes);
  T* stages = reinterpret_cast<T*>(shared_bytes + Layout::kQueryBytes);

  const int head = static_cast<int>(blockIdx.y);
  PrefillTile cta = PrefillTile::of_this_cta<kQueryRows>(p);
  if (cta.idle()) return;
  cta.find_keys<kQueryRows>(p);
  const int row = cta.row, q_begin = cta.q_begin, q_len = cta.q_len, m0 = cta.m0, seq_len = cta.seq_len;
  const int tile_first_pos = cta.first_pos, kv_begin = cta.kv_begin, kv_end = cta.kv_end;
  const int span = p.window_span;  // INT_MAX without a window
  const int num_tiles = cta.num_key_tiles<kKeys>();
  // Whether every query of the CTA sees every key of the tile at first_key (no mask needed).
  auto unmasked_tile = [&](int first_key) {
    return first_key + kKeys - 1 <= tile_first_pos && tile_first_pos + kQueryRows - 1 - first_key < span;
  };
  const int kv_head = head / (p.num_heads / p.num_kv_heads);

  const int tid = static_cast<int>(threadIdx.x);
  const int64_t token_stride = static_cast<int64_t>(p.num_heads) * kHeadDim;
  const T* query = static_cast<const T*>(p.query) + (q_begin + m0) * token_stride + head * kHeadDim;
  const int32_t* block_table = p.block_tables + static_cast<int64_t>(row) * p.max_blocks_per_seq;
  const T* key_cache = static_cast<const T*>(p.key_cache);
  const T* value_cache = static_cast<const T*>(p.value_cache);
  auto key_tile = [&](int tile) { return stages + tile % kStages * 2 * Layout::kTileElems; };
  auto value_tile = [&](int tile) { return key_tile(tile) + Layout::kTileElems; };
  auto load_tile = [&](int tile) {
    load_kv_tiles_async<T, kHeadDim, kBlockSize, kKeys, kThreads>(key_tile(tile), value_tile(tile), key_cache,
                                                                       value_cache, block_table,
                                                                       kv_begin + tile * kKeys, kv_end, kv_head,
                                                                       p.num_kv_heads, tid);
  };

  load_rows_async<T, kHeadDim, kQueryRows, kThreads>(query_tile, query, token_stride, min(q_len - m0, kQueryRows), tid);
#pragma unroll
  for (int tile = 0; tile < kStages - 1; ++tile) {
    if (tile < num_tiles) load_tile(tile);
    cp_async_commit();  // one group per tile slot, empty or not, keeps the wait counts uniform
  }

  const int warp = tid / 32;
  const int lane = tid % 32;
  const int warp_first_pos = tile_first_pos + warp * kWarpRows;
  const ScoreMap score = ScoreMap::make(p.scale, p.softcap);
  uint32_t q_frag[kHeadDim / 16][4];
  WarpAttentionState<kHeadDim> state;
  cp_async_wait<kStages - 2>();
  __syncthreads();
  load_query_fragments<T, kHeadDim>(q_frag, query_tile + warp * kWarpRows * kHeadDim, lane);
  for (int tile = 0; tile < num_tiles; ++tile) {
    if (tile > 0) {
      cp_async_wait<kStages - 2>();  // this tile landed for this thread...
      __syncthreads();               // ...and for all; everyone is done with the stage reloaded next
    }
    if (tile + kStages - 1 < num_tiles) load_tile(tile + kStages - 1);
    cp_async_commit();
    const int first_key = kv_begin + tile * kKeys;
    if (first_key > warp_first_pos + kWarpRows - 1) continue;  // wholly in this warp's future
    if (warp_first_pos - (first_key + kKeys - 1) >= span) continue;  // wholly before this warp's windows
    const bool full_tile = unmasked_tile(first_key);
    auto future = [&](int r, int key) {  // or before the row's window
      const int position = first_key + key;
      const int query = warp_first_pos + r;
      return position > query || position >= seq_len || query - position >= span;
    };
    if constexpr (kKeys > 64) {
      // One inlined copy of the tile code: a second, mask-free one costs registers 128-key tiles lack.
      warp_attend<T, kHeadDim, kKeys>(state, q_frag, key_tile(tile), value_tile(tile), score, lane,
                                      [&](int r, int key) { return !full_tile && future(r, key); });
    } else if (full_tile) {
      warp_attend<T, kHeadDim, kKeys>(state, q_frag, key_tile(tile), value_tile(tile), score, lane,
                                      [](int, int) { return false; });
    } else {
      warp_attend<T, kHeadDim, kKeys>(state, q_frag, key_tile(tile), value_tile(tile), score, lane, future);
    }
  }
  cp_async_wait<0>();  // nothing may land in shared memory after the CTA exits

  T* out = static_cast<T*>(p.out) + (q_begin + m0) * token_stride + head * kHeadDim;
  store_warp_rows<T, kHeadDim>(state, out, token_stride, warp * kWarpRows, min(q_len - m0, kQueryRows), lane);
}

}  // namespace prefill

// Launches the prefill kernel for rows [p.num_decodes, p.num_seqs) with one CTA shape.
template <typename T, int kHeadDim, int kBlockSize, typename Shape>
void launch_prefill_attention_shaped(const PagedAttentionParams& p, cudaStream_t stream) {
  using Layout = prefill::SharedLayout<T, kHeadDim, Shape>;
  const dim3 grid(static_cast<unsigned>(ceil_div(p.max_query_len, Shape::kQueryRows)),
                  static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.num_seqs - p.num_decodes));
  auto* kernel = prefill::prefill_attention_kernel<T, kHeadDim, kBlockSize, Shape>;
  allow_dynamic_smem(kernel, Layout::kBytes, "prefill_attention_kernel");
  kernel<<<grid, Shape::kThreads, Layout::kBytes, stream>>>(p);
  check_launch("prefill_attention_kernel");
}

// Launches the prefill kernel for rows [p.num_decodes, p.num_seqs): at head
// dim 128 the wgmma kernel wherever the card and build have it, otherwise the
// mma.sync kernel, its CTA shape chosen from the longest query (outputs are the
// same either way).
template <typename T, int kHeadDim, int kBlockSize>
void launch_prefill_attention(const PagedAttentionParams& p, cudaStream_t stream) {
  if constexpr (kHeadDim == prefill_wgmma::kHeadDim) {
    if (prefill_wgmma::takes(kHeadDim)) {
      launch_prefill_attention_wgmma<T, kBlockSize>(p, stream);
      return;
    }
    if (p.max_query_len >= prefill::kWideQueryLen) {
      launch_prefill_attention_shaped<T, kHeadDim, kBlockSize, prefill::WideShape>(p, stream);
      return;
    }
  }
  launch_prefill_attention_shaped<T, kHeadDim, kBlockSize, prefill::DefaultShape<kHeadDim>>(p, stream);
}

}  // namespace pagedserve::cuda
