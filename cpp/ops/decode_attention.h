// The row kernel of the CPU paged attention on AVX-512: each query row (one
// query token, one head) against its visible float32 or bf16 context, with
// float32 queries.
//
// The general tile kernel (attention_tile.h) folds the context 16 positions
// at a time with an online softmax and spends most of its time on per-pair
// dot-product reductions. This path computes all of a row's scores first (16
// keys at once: 16 partial-dot vectors reduced together by a shuffle tree),
// then one softmax over the whole row, then the value sum: the same float32
// math without the per-tile rescaling. A sliding window starts the row at its
// window; soft-capping maps the scores with the tile kernel's tanh_approx
// (attention_options.h). A bf16 cache is widened to float32 as it is loaded
// (a 16-bit shift: exact), accumulation stays float32.
//
// A query's heads of one group share its keys and values, so they run
// together: each 16-key tile is read (a bf16 cache widened) once for all of
// them, their value sums run up to 4 rows a pass (each value chunk loaded and
// widened once, enough independent multiply-add chains to fill both FMA
// ports), and where each position lies in the cache is computed once per work
// item; every row's arithmetic stays what it is alone. On 2 cores of an Intel
// Emerald Rapids VM, SmolLM2 (group 3, bf16 cache): one layer's 512-token
// prefill attention 7.2-8.8 -> 4.1-4.9 ms, the model's TTFT 0.55-0.63 ->
// 0.36-0.44 s, with the same bits (bench/results/intel_amx/session41.md).
//
// Batch invariance: a row's arithmetic depends only on its query and its
// visible keys and values, never on the other rows of the item or the batch.
// That is why this kernel serves prefill rows as well as decode rows where it
// applies: with a decode-only fast path, the last prompt token would round
// differently when a prefix-cache hit or a chunk boundary leaves it alone in
// its chunk (q_len 1) than inside a longer prefill.
#pragma once

#include <cstdint>
#include <vector>

#include "ops/attention_tile.h"
#include "ops/float_types.h"

namespace pagedserve::ops {

// Whether attend_rows_avx512 handles this shape on this CPU (float32 queries,
// head dim a multiple of 16 up to kMaxRowHeadDim, AVX-512 on).
inline constexpr int64_t kMaxRowHeadDim = 256;
bool row_attention_supported(int64_t head_dim);

// One worker's scratch, grown as items need it: the group's scores (a row of each head), where each
// visible position lies in the cache, the group's scaled queries and a tile of keys as float32.
class RowScratch {
 public:
  float* scores(int64_t n) { return grown(scores_, n); }
  int64_t* offsets(int64_t n) { return grown(offsets_, n); }
  float* queries(int64_t n) { return grown(queries_, n); }
  float* keys(int64_t n) { return grown(keys_, n); }

 private:
  template <typename T>
  static T* grown(std::vector<T>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
    return v.data();
  }
  std::vector<float> scores_;
  std::vector<int64_t> offsets_;
  std::vector<float> queries_;  // a group's scaled queries
  std::vector<float> keys_;     // a tile's keys as float32
};

// Writes the outputs of every query of item, for its group's heads.
void attend_rows_avx512(const AttentionBatch<float, float>& batch, const AttentionWorkItem& item,
                        RowScratch& scratch);
void attend_rows_avx512(const AttentionBatch<float, BFloat16>& batch, const AttentionWorkItem& item,
                        RowScratch& scratch);

}  // namespace pagedserve::ops
