// Per-call score options of paged_attention (CPU and CUDA alike), both off by
// default: sliding-window attention (Mistral, Gemma 2/3, Qwen2 windows) and
// logit soft-capping (Gemma 2).
//
// window W > 0: the query at position p sees keys at positions k with
//   p - W < k <= p   (W keys, itself included)
// which is transformers' sliding_window_causal mask (masking_utils.py:
// `kv_idx > q_idx - sliding_window`) and vLLM's / FlashAttention's
// window_size = (W - 1, 0). Keys before the window are never read: block
// table entries of blocks that lie wholly before every query's window may hold
// anything (the contract does not check them), so a scheduler can give those
// blocks back to the pool.
//
// softcap c > 0: each scaled score s = scale * q.k becomes c * tanh(s / c)
// before the mask and the softmax (Gemma 2's attn_logit_softcapping).
#pragma once

#include <algorithm>
#include <cstdint>

namespace pagedserve::ops {

struct AttentionOptions {
  int32_t window = 0;    // 0: full causal attention
  float softcap = 0.0f;  // 0: no capping
  // CUDA: split each decode row's context into fixed 512-token partitions
  // instead of the plan's (whole contexts when the batch fills the card, finer
  // ones when it is small), so a row's result does not depend on the batch
  // (--batch-invariant). The CPU kernel always reduces a row in an order fixed
  // by the row alone.
  bool fixed_split = false;

  // The first position a query at `position` sees.
  constexpr int64_t first_visible(int64_t position) const {
    return window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
  }
};

}  // namespace pagedserve::ops
