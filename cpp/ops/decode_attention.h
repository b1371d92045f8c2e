// The decode fast path of the CPU paged attention: one query token of one
// sequence (all query heads of one GQA group) against its float32 context,
// on AVX-512.
//
// The general tile kernel (attention_tile.h) folds the context 16 positions
// at a time with an online softmax and spends most of its time on per-pair
// dot-product reductions. A decode row has one query, so this path computes
// all of its scores first (16 keys at once: 16 partial-dot vectors reduced
// together by a shuffle tree), then one softmax over the whole row, then the
// value sum: the same float32 math without the per-tile rescaling. A sliding
// window starts the row at its window; soft-capping maps the scores with the
// tile kernel's tanh_approx (attention_options.h).
#pragma once

#include <cstdint>

#include "ops/attention_tile.h"

namespace pagedserve::ops {

// Whether attend_decode_avx512 handles this shape on this CPU (float32
// caches, head dim a multiple of 16 up to kMaxDecodeHeadDim, AVX-512 on).
inline constexpr int64_t kMaxDecodeHeadDim = 256;
bool decode_attention_supported(int64_t head_dim);

// Writes the outputs of item (which must have q_len == 1) for its group's
// heads. scores: scratch of at least seq_len floats.
void attend_decode_avx512(const AttentionBatch<float>& batch, const AttentionWorkItem& item, float* scores);

}  // namespace pagedserve::ops
