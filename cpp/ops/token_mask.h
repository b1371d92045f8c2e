// The structured-output token bitmask, one rule for the host and the GPU.
//
// Both grammar backends (xgrammar, llguidance) write a row of int32 words per
// logits row, token v allowed when bit v % 32 of word v / 32 is set; the
// sampling op (ops.h sample_tokens) and its CUDA kernel read it through these.
#pragma once

#include <cstdint>

#include "hash_mix.h"  // PS_HOST_DEVICE

namespace pagedserve::ops {

// Words in one row of the mask of a vocabulary of `vocab` tokens.
PS_HOST_DEVICE int64_t token_mask_words(int64_t vocab) { return (vocab + 31) / 32; }

// Whether token v is allowed by `row_mask` (one row of the bitmask; null: every token is).
PS_HOST_DEVICE bool token_allowed(const int32_t* row_mask, int64_t v) {
  return row_mask == nullptr || ((static_cast<uint32_t>(row_mask[v / 32]) >> (v % 32)) & 1u) != 0;
}

}  // namespace pagedserve::ops
