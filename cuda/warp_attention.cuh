// One warp's share of flash attention on tensor cores: 16 query rows (the
// M of mma.m16n8k16) against key / value tiles staged in shared memory, with
// an online softmax kept in registers. The prefill kernel's rows are 16 query
// tokens; the decode kernel (whose rows are the query heads of one kv head)
// uses warp_scores and runs its own softmax across warps. The wgmma prefill
// kernel (prefill_attention_wgmma.cuh) runs map_scores, the softmax and
// store_warp_rows on a warpgroup MMA's results, laid out as mma.sync's.
//
// Per lane (g = lane / 4, q = lane % 4) the state covers rows g and g + 8:
// the running max m and partial sum l of each row, and the 16 x D output O as
// D / 8 C fragments. Scores are in the log2 domain.
#pragma once

#include <cstdint>

#include "attention_common.cuh"
#include "float_convert.cuh"
#include "mma.cuh"
#include "smem_tile.cuh"

namespace pagedserve::cuda {

inline constexpr int kWarpQueryRows = 16;  // the M of mma.m16n8k16: query rows a warp owns

template <int kHeadDim>
struct WarpAttentionState {
  float max[2] = {-INFINITY, -INFINITY};  // rows g, g + 8
  float sum[2] = {0.f, 0.f};              // this lane's share until finish_sums()
  float out[kHeadDim / 8][4] = {};        // C fragment per 8 output columns

  // Completes the row sums across the quad (each lane summed its own columns).
  __device__ __forceinline__ void finish_sums() {
    sum[0] = quad_sum(sum[0]);
    sum[1] = quad_sum(sum[1]);
  }
};

// A fragments of the 16 x D query tile rows [0, 16) of `tile`, one per k-step of 16 dims.
template <typename T, int kHeadDim>
__device__ __forceinline__ void load_query_fragments(uint32_t (&q)[kHeadDim / 16][4], const T* tile, int lane) {
  const LaneTileOffsets<kHeadDim> rows(lane % 16, lane / 16);
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) ldmatrix_x4(q[ks], tile + rows(0, ks));
}

// Dot products (C fragments of 16 rows x 8 keys each) -> log2-domain scores,
// mapped by `score` (scale and soft-capping); masked(row, key) ones -inf.
template <int kKeyTiles, typename Masked>
__device__ __forceinline__ void map_scores(float (&s)[kKeyTiles][4], const ScoreMap& score, int lane, Masked masked) {
  const int g = lane / 4;
  const int key_in_tile = 2 * (lane % 4);
  auto map_all = [&](auto map) {
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool hidden = masked(g + (e / 2) * 8, n * 8 + key_in_tile + e % 2);
        s[n][e] = hidden ? -INFINITY : map(s[n][e]);
      }
    }
  };
  if (score.capped) {  // uniform across the grid
    map_all([&](float dot) { return score.capped_score(dot); });
  } else {
    map_all([&](float dot) { return dot * score.scale_log2; });
  }
}

// Scores of the warp's 16 query rows against kKeys keys (rows [0, kKeys) of
// the swizzled key tile), in the log2 domain (mapped by `score`: scale and
// soft-capping): s[n] is the C fragment of keys [8n, 8n + 8). masked(row, key)
// says whether row (0..15) must not see key (0..kKeys-1), which then scores
// -inf; pass a lambda returning false for none.
template <typename T, int kHeadDim, int kKeys, typename Masked>
__device__ __forceinline__ void warp_scores(float (&s)[kKeys / 8][4], const uint32_t (&q)[kHeadDim / 16][4],
                                            const T* keys, const ScoreMap& score, int lane, Masked masked) {
  const LaneTileOffsets<kHeadDim> key_rows((lane / 16) * 8 + lane % 8, (lane / 8) % 2);
  static_assert(kKeys % 16 == 0, "keys come in k-steps of 16");
  // An x4 ldmatrix yields b0/b1 for keys [0, 8) and [8, 16) of a 16-key slice.
  // Either loop order sums each score over k in the same order; key slices
  // outermost keeps fewer fragments live (128-key tiles need that), head-dim
  // steps outermost schedules better where registers allow.
#pragma unroll
  for (int n = 0; n < kKeys / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
  auto score_slice = [&](int slice, int ks) {
    uint32_t b[4];
    ldmatrix_x4(b, keys + key_rows(slice * 16, ks));
    mma_m16n8k16<T>(s[2 * slice], q[ks], b[0], b[1]);
    mma_m16n8k16<T>(s[2 * slice + 1], q[ks], b[2], b[3]);
  };
  if constexpr (kKeys > 64) {
#pragma unroll
    for (int slice = 0; slice < kKeys / 16; ++slice) {
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) score_slice(slice, ks);
    }
  } else {
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
#pragma unroll
      for (int slice = 0; slice < kKeys / 16; ++slice) score_slice(slice, ks);
    }
  }
  map_scores<kKeys / 8>(s, score, lane, masked);
}

// exp2_shifted on one MUFU.EX2: a probability below 2^-126 (a score 126
// below its row's max) becomes 0 instead of a subnormal, which moves neither
// the row sum (>= 1) nor, rounded to 16 bits, P V. The softmax is most of a
// prefill tile's non-mma instructions: 32 exponents per lane, three
// instructions fewer each (H200, one causal prompt of 4096 tokens, 32 / 8
// heads: D 128 211 -> 217 TFLOP/s, D 64 180 -> 188; outputs bit for bit the
// same, SDPA's included).
__device__ __forceinline__ float probability(float score, float max) {
  return exp2_ftz(shifted(score, max));
}

// The online softmax over one tile's scores s (log2 domain, in place): each
// row's running max moves up to the tile's, the running sum l is rescaled and
// grows by the tile's, and s becomes the probabilities exp2(s - max).
// rescale[half] is what O, accumulated under the old max, must be multiplied
// by (rescale_output) before the tile's P V is added.
template <int kHeadDim, int kKeyTiles>
__device__ __forceinline__ void softmax_tile(WarpAttentionState<kHeadDim>& state, float (&s)[kKeyTiles][4],
                                             float (&rescale)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float m = -INFINITY;
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) m = fmaxf(m, fmaxf(s[n][2 * half], s[n][2 * half + 1]));
    const float new_max = fmaxf(state.max[half], quad_max(m));
    rescale[half] = probability(state.max[half], new_max);
    state.max[half] = new_max;
    float tile_sum = 0.f;
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) {
      s[n][2 * half] = probability(s[n][2 * half], new_max);
      s[n][2 * half + 1] = probability(s[n][2 * half + 1], new_max);
      tile_sum = (tile_sum + s[n][2 * half]) + s[n][2 * half + 1];
    }
    state.sum[half] = state.sum[half] * rescale[half] + tile_sum;
  }
}

template <int kHeadDim>
__device__ __forceinline__ void rescale_output(WarpAttentionState<kHeadDim>& state, const float (&rescale)[2]) {
#pragma unroll
  for (int d = 0; d < kHeadDim / 8; ++d) {
#pragma unroll
    for (int e = 0; e < 4; ++e) state.out[d][e] *= rescale[e / 2];
  }
}

// Both steps at once, for a tile whose P V follows at once.
template <int kHeadDim, int kKeyTiles>
__device__ __forceinline__ void online_softmax(WarpAttentionState<kHeadDim>& state, float (&s)[kKeyTiles][4]) {
  float rescale[2];
  softmax_tile(state, s, rescale);
  rescale_output(state, rescale);
}

// Probabilities of keys [16 slice, 16 slice + 16) rounded to T: the two C
// fragments of those keys are, packed in pairs, one A fragment (of mma.sync,
// and of a register-A wgmma) for P V.
template <typename T, int kKeyTiles>
__device__ __forceinline__ void probability_fragment(uint32_t (&p)[4], const float (&s)[kKeyTiles][4], int slice) {
  p[0] = pack2<T>(s[2 * slice][0], s[2 * slice][1]);
  p[1] = pack2<T>(s[2 * slice][2], s[2 * slice][3]);
  p[2] = pack2<T>(s[2 * slice + 1][0], s[2 * slice + 1][1]);
  p[3] = pack2<T>(s[2 * slice + 1][2], s[2 * slice + 1][3]);
}

// Attends the warp's 16 query rows to kKeys keys: rows [0, kKeys) of the
// swizzled key and value tiles, masked as in warp_scores.
//
// Rounding follows cuDNN's fused attention (which torch SDPA picks on Hopper;
// bench/numerics/softmax_numerics.py measured it): scores in float32, scaled into the
// log2 domain, probabilities exp2(s - m) against the running max m over the
// tiles seen so far, rounded to T for P V; each lane sums its unrounded
// probabilities of the tile one at a time in fragment order and adds that to
// the rescaled running sum.
template <typename T, int kHeadDim, int kKeys, typename Masked>
__device__ __forceinline__ void warp_attend(WarpAttentionState<kHeadDim>& state,
                                            const uint32_t (&q)[kHeadDim / 16][4], const T* keys, const T* values,
                                            const ScoreMap& score, int lane, Masked masked) {
  constexpr int kKeyTiles = kKeys / 8;  // C fragments of scores, 8 keys each
  float s[kKeyTiles][4];
  warp_scores<T, kHeadDim, kKeys>(s, q, keys, score, lane, masked);
  online_softmax(state, s);

  // O += P V. Two score fragments (16 keys) form one A fragment; ldmatrix.trans
  // of the value rows yields b0/b1 for output columns [0, 8) and [8, 16) of a 16-column slice.
  const LaneTileOffsets<kHeadDim> value_rows(lane % 16, lane / 16);
#pragma unroll
  for (int slice = 0; slice < kKeys / 16; ++slice) {
    uint32_t p[4];
    probability_fragment<T>(p, s, slice);
#pragma unroll
    for (int dn = 0; dn < kHeadDim / 16; ++dn) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, values + value_rows(slice * 16, dn));
      mma_m16n8k16<T>(state.out[2 * dn], p, b[0], b[1]);
      mma_m16n8k16<T>(state.out[2 * dn + 1], p, b[2], b[3]);
    }
  }
}

// Writes the warp's finished rows [first_row, first_row + 16) of a tile of
// num_rows valid rows (those inside the chunk) as O / l, row r at out + r * row_stride.
template <typename T, int kHeadDim>
__device__ __forceinline__ void store_warp_rows(WarpAttentionState<kHeadDim>& state, T* out, int64_t row_stride,
                                                int first_row, int num_rows, int lane) {
  state.finish_sums();
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = first_row + lane / 4 + 8 * half;
    if (r >= num_rows) continue;
    const float sum = state.sum[half];
    const float inv_sum = approx_reciprocal_or_zero(sum);
    T* dst = out + r * row_stride + 2 * (lane % 4);
#pragma unroll
    for (int d = 0; d < kHeadDim / 8; ++d) {
      const float pair[2] = {state.out[d][2 * half] * inv_sum, state.out[d][2 * half + 1] * inv_sum};
      store_from_float(dst + 8 * d, pair);
    }
  }
}

}  // namespace pagedserve::cuda
