"""Row-vectorized logits processing: each function transforms a [R, V] batch.

Semantics follow vLLM v1 so outputs match users' expectations; the
implementations avoid per-row Python work and keep the number of passes over
the [R, V] logits small. Functions named ``apply_*`` return a new tensor unless
their name ends in ``_`` (those modify their argument, which the caller owns).
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedserve.sample.sampling_tensors import LogitsProcessors, PenaltyTokens

NEG_INF = float("-inf")


def apply_min_tokens(logits: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """Forbid the (row, token) pairs in ``blocked`` [2, M]: stop tokens before min_tokens."""
    # torch.full fills on the device; a tensor built from a Python float would be a host copy.
    forbidden = torch.full((), NEG_INF, device=logits.device, dtype=logits.dtype)
    return logits.index_put((blocked[0], blocked[1]), forbidden)


def apply_logits_processors(logits: torch.Tensor, processors: LogitsProcessors) -> torch.Tensor:
    """allowed_token_ids (everything else -inf), bad words (-inf), then logit_bias (added)."""
    forbidden = torch.full((), NEG_INF, device=logits.device, dtype=logits.dtype)
    if processors.allowed_rows is not None:
        assert processors.allowed is not None
        disallowed = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        disallowed[processors.allowed_rows] = True
        keep = torch.zeros((), dtype=torch.bool, device=logits.device)
        disallowed.index_put_((processors.allowed[0], processors.allowed[1]), keep)
        logits = logits.masked_fill(disallowed, NEG_INF)
    if processors.banned is not None:
        logits = logits.index_put((processors.banned[0], processors.banned[1]), forbidden)
    if processors.bias_index is not None:
        assert processors.bias is not None
        logits = logits.index_put((processors.bias_index[0], processors.bias_index[1]),
                                  processors.bias.to(logits.dtype), accumulate=True)
    return logits


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTokens) -> torch.Tensor:
    """Repetition (HF/CTRL), then frequency and presence (OpenAI) penalties."""
    num_rows, vocab_size = logits.shape
    prompt_tokens = penalties.tokens[:, :penalties.prompt_len]
    output_tokens = penalties.tokens[:, penalties.prompt_len:]
    # One scratch column (index vocab_size) absorbs the padding.
    output_counts = torch.zeros(num_rows, vocab_size + 1, dtype=logits.dtype, device=logits.device)
    output_counts.scatter_add_(1, output_tokens, torch.ones_like(output_tokens, dtype=logits.dtype))
    output_counts = output_counts[:, :vocab_size]
    in_output = output_counts > 0
    if penalties.repetition is not None:
        seen = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, prompt_tokens, True)
        seen = seen[:, :vocab_size] | in_output
        factor = penalties.repetition
        # Dividing a positive logit and multiplying a negative one both make the
        # token less likely; a plain division would reward negative logits.
        penalized = torch.where(logits > 0, logits / factor, logits * factor)
        logits = torch.where(seen, penalized, logits)
    if penalties.frequency is not None:
        logits = logits - penalties.frequency * output_counts
    if penalties.presence is not None:
        logits = logits - penalties.presence * in_output.to(logits.dtype)
    return logits


def apply_min_p_(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens whose probability is below ``min_p`` times the row's top probability.

    prob_i >= min_p * prob_max  <=>  logit_i >= logit_max + log(min_p), so no
    softmax is needed; min_p = 0 gives a threshold of -inf (keeps everything).
    """
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)
    logits.masked_fill_(logits < threshold, NEG_INF)


# Up to this k a partial selection (topk) beats a full sort of the vocabulary.
TOP_K_SELECT_LIMIT = 256


def apply_top_k_top_p_(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                       top_p: Optional[torch.Tensor], max_top_k: int) -> None:
    """Keep each row's top_k tokens, then the smallest prefix holding top_p of their mass.

    top_k: [R] int64 in [1, V] (V = disabled), max_top_k the largest enabled
    value; top_p: [R, 1] in (0, 1]. Ties with a row's cutoff logit survive.
    """
    if top_p is None and top_k is not None and max_top_k <= TOP_K_SELECT_LIMIT:
        _apply_top_k_by_selection_(logits, top_k, max_top_k)
    else:
        _apply_top_k_top_p_by_sort_(logits, top_k, top_p)


def _apply_top_k_by_selection_(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    vocab_size = logits.shape[-1]
    best = logits.topk(max_top_k, dim=-1).values  # descending
    cutoff = best.gather(1, (top_k.clamp_max(max_top_k) - 1).unsqueeze(1))
    cutoff.masked_fill_((top_k >= vocab_size).unsqueeze(1), NEG_INF)  # rows without top_k
    logits.masked_fill_(logits < cutoff, NEG_INF)


def _apply_top_k_top_p_by_sort_(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                                top_p: Optional[torch.Tensor]) -> None:
    """One descending sort finds, per row, the smallest logit that survives both
    filters; everything strictly below it is masked in the unsorted tensor, so
    no scatter back is needed."""
    vocab_size = logits.shape[-1]
    sorted_logits, _ = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        positions = torch.arange(vocab_size, device=logits.device)
        sorted_logits.masked_fill_(positions >= top_k.unsqueeze(1), NEG_INF)
        kept = top_k
    else:
        kept = torch.full((logits.shape[0],), vocab_size, device=logits.device)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Token i survives while the tokens ranked above it hold less than top_p.
        within_p = (mass_before < top_p).sum(dim=-1).clamp_min(1)
        # Rows without top_p keep everything: float rounding can push the running
        # mass to 1.0 before the tail, which would silently drop tiny tokens.
        within_p.masked_fill_(top_p.squeeze(1) >= 1.0, vocab_size)
        kept = torch.minimum(kept, within_p)
    cutoff = sorted_logits.gather(1, (kept - 1).unsqueeze(1))
    logits.masked_fill_(logits < cutoff, NEG_INF)


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Sample one token per row: argmax(probs / q) with q ~ Exp(1) is a draw from probs.

    (The winner is the first arrival among independent exponential clocks with
    rates probs_i, which arrives first with probability probs_i.) ``noise`` is
    consumed. Clamping q away from 0 keeps masked tokens (prob 0) from turning
    into NaN, which argmax would pick.
    """
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return torch.div(probs, noise, out=noise).argmax(dim=-1)
