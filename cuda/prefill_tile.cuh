// The share of a prefill row one CTA of a prefill kernel computes, and the
// keys it reads. Grid: (query tile, query head, prefill row); query tiles are
// launched last first, the heaviest under causality, to shorten the tail.
// Causality: query i of a row's chunk sits at position seq_len - q_len + i
// (after its cached prefix); a window W lets it see positions > its own - W.
#pragma once

#include "attention_params.h"

namespace pagedserve::cuda {

struct PrefillTile {
  int row;        // the batch row (decode rows come first)
  int q_begin;    // the row's first query token in the batch
  int q_len;      // query tokens of the row
  int m0;         // the tile's first query within the row
  int seq_len;    // the row's context, its chunk included
  int first_pos;  // position of the tile's first query
  int kv_begin;   // keys [kv_begin, kv_end): from the first query's window start to the last query
  int kv_end;

  // This CTA's tile of kQueryRows queries (the row's lengths are read by find_keys, once it is not idle).
  template <int kQueryRows>
  __device__ static PrefillTile of_this_cta(const PagedAttentionParams& p) {
    PrefillTile t;
    t.row = p.num_decodes + static_cast<int>(blockIdx.z);
    t.q_begin = p.query_start_loc[t.row];
    t.q_len = p.query_start_loc[t.row + 1] - t.q_begin;
    t.m0 = static_cast<int>(gridDim.x - 1 - blockIdx.x) * kQueryRows;
    return t;
  }
  // A tile past the row's queries: the CTA exits at once (no host-side tile list; grid x from max_query_len).
  __device__ bool idle() const { return m0 >= q_len; }

  // Reads the row's length and sets the key range (only for a CTA that is not idle).
  template <int kQueryRows>
  __device__ void find_keys(const PagedAttentionParams& p) {
    seq_len = p.seq_lens[row];
    const int span = p.window_span;  // INT_MAX without a window
    first_pos = seq_len - q_len + m0;
    kv_begin = first_pos >= span ? first_pos - span + 1 : 0;
    kv_end = min(seq_len, first_pos + kQueryRows);
  }
  template <int kKeys>
  __device__ int num_key_tiles() const {
    return kv_end > kv_begin ? (kv_end - kv_begin + kKeys - 1) / kKeys : 0;
  }
};

}  // namespace pagedserve::cuda
