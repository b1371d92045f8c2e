"""SamplingBatch: one step's per-row sampling parameters, gathered once per call.

The sampler's kernels are row-vectorized, so every per-request knob becomes a
[R] tensor and every per-request token history a padded [R, L] tensor. This
module does that gathering on the host (plain Python and numpy, no device
syncs), ships everything to the device in as few copies as possible, and keeps
the host-side flags the sampler uses to skip work nobody asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional, Sequence

import numpy as np
import torch

from pagedserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One row of logits: a sequence whose step finished its pending tokens."""

    params: SamplingParams
    num_samples: int  # n when the prompt is about to fork (parallel sampling), else 1
    prompt_token_ids: Sequence[int]  # repetition penalty covers prompt + output (HF/vLLM)
    output_token_ids: Sequence[int]  # generated so far: penalties and min_tokens
    generator: Optional[torch.Generator] = None  # per-request (from params.seed); None: shared

    @cached_property
    def plain_settings(self) -> bool:
        """One draw from softmax(logits / T) as far as the request's settings go (no parallel samples,
        penalties, logprobs, processors or truncation). Cached: the sampler asks every step, and a row's
        params and sample count do not change."""
        p = self.params
        return (self.num_samples == 1 and not p.has_penalties and p.logprobs is None and not p.has_logits_processors
                and (p.greedy or not (p.top_k_enabled or p.top_p < 1.0 or p.min_p > 0.0)))


@dataclass
class PenaltyTokens:
    """Token histories for the penalized rows, padded with ``vocab_size``.

    ``tokens[:, :prompt_len]`` are prompt tokens (only for rows with a
    repetition penalty), ``tokens[:, prompt_len:]`` output tokens. The pad id
    lands in a scratch column that is dropped after the scatter.
    """

    tokens: torch.Tensor  # [R, prompt_len + output_len] int64
    prompt_len: int
    repetition: Optional[torch.Tensor]  # [R, 1]; None when no row has one
    frequency: Optional[torch.Tensor]  # [R, 1]
    presence: Optional[torch.Tensor]  # [R, 1]


@dataclass
class LogitsProcessors:
    """logit_bias, allowed_token_ids and bad_words of the rows that use them, as sparse
    (row, token) index pairs: the [R, V] logits are touched only where a row asked."""

    allowed_rows: Optional[torch.Tensor]  # [A] rows restricted to their allowed_token_ids
    allowed: Optional[torch.Tensor]  # [2, K] (row, token) pairs those rows may sample
    banned: Optional[torch.Tensor]  # [2, M] (row, token) pairs a bad word forbids now
    bias_index: Optional[torch.Tensor]  # [2, B] (row, token) pairs with a logit_bias
    bias: Optional[torch.Tensor]  # [B] float32 biases


@dataclass
class SeededSamples:
    """Samples ``[start, start + count)`` draw their noise from ``generator``."""

    start: int
    count: int
    generator: torch.Generator


@dataclass
class SamplingBatch:
    num_rows: int
    num_samples: int  # S = sum of rows' num_samples
    all_greedy: bool
    greedy_rows: Optional[torch.Tensor]  # [R] bool; None when no row is greedy
    temperature: Optional[torch.Tensor]  # [R, 1]; 1 for greedy rows; None when all greedy
    min_p: Optional[torch.Tensor]  # [R, 1]; None when no row uses min_p
    top_k: Optional[torch.Tensor]  # [R] int64, vocab_size when disabled; None when unused
    max_top_k: int  # the largest enabled top_k (0 when unused)
    top_p: Optional[torch.Tensor]  # [R, 1]; None when no row uses top_p
    penalties: Optional[PenaltyTokens]
    min_tokens_block: Optional[torch.Tensor]  # [2, M] (row, token) pairs to mask
    processors: Optional[LogitsProcessors]  # None when no row uses logit_bias / allowed_token_ids / bad_words
    sample_rows: Optional[torch.Tensor]  # [S] row of each sample; None when S == R
    sample_rows_host: list[int]
    seeded: list[SeededSamples]
    max_logprobs: Optional[int]  # largest top-N asked for; None when no row asked
    requested_logprobs: list[Optional[int]]  # per row: top-N asked for, None: no logprobs


def build_sampling_batch(rows: Sequence[SamplingRow], vocab_size: int,
                         eos_token_ids: Sequence[int], device: torch.device) -> SamplingBatch:
    params = [row.params for row in rows]
    sample_rows_host = [i for i, row in enumerate(rows) for _ in range(row.num_samples)]
    greedy = [p.greedy for p in params]
    all_greedy = all(greedy)
    logprob_counts = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingBatch(
        num_rows=len(rows),
        num_samples=len(sample_rows_host),
        all_greedy=all_greedy,
        greedy_rows=_to_device(torch.tensor(greedy), device) if any(greedy) else None,
        **_shaping_tensors(params, vocab_size, device, all_greedy),
        penalties=_penalty_tokens(rows, vocab_size, device),
        min_tokens_block=_min_tokens_block(rows, vocab_size, eos_token_ids, device),
        processors=(_logits_processors(rows, vocab_size, device)
                    if any(p.has_logits_processors for p in params) else None),
        sample_rows=(None if len(sample_rows_host) == len(rows)
                     else _to_device(torch.tensor(sample_rows_host, dtype=torch.int64), device)),
        sample_rows_host=sample_rows_host,
        seeded=_seeded_samples(rows),
        max_logprobs=min(max(logprob_counts), vocab_size) if logprob_counts else None,
        requested_logprobs=[p.logprobs for p in params],
    )


def _shaping_tensors(params: Sequence[SamplingParams], vocab_size: int, device: torch.device,
                     all_greedy: bool) -> dict[str, Any]:
    """temperature, min_p, top_k and top_p, shipped to the device in one copy."""
    if all_greedy:
        return dict(temperature=None, min_p=None, top_k=None, max_top_k=0, top_p=None)
    temperature = [1.0 if p.greedy else p.temperature for p in params]
    min_p = [p.min_p for p in params]
    # top_k travels as float32: exact for any vocabulary below 2**24 tokens.
    top_k = [min(p.top_k, vocab_size) if p.top_k_enabled else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    packed = torch.tensor([temperature, min_p, top_k, top_p], dtype=torch.float32)
    packed = _to_device(packed, device)
    return dict(
        temperature=packed[0].unsqueeze(1),
        min_p=packed[1].unsqueeze(1) if any(v > 0.0 for v in min_p) else None,
        top_k=packed[2].long() if any(k < vocab_size for k in top_k) else None,
        max_top_k=max((k for k in top_k if k < vocab_size), default=0),
        top_p=packed[3].unsqueeze(1) if any(v < 1.0 for v in top_p) else None,
    )


def _penalty_tokens(rows: Sequence[SamplingRow], vocab_size: int,
                    device: torch.device) -> Optional[PenaltyTokens]:
    params = [row.params for row in rows]
    if not any(p.has_penalties for p in params):
        return None
    with_repetition = [p.repetition_penalty != 1.0 for p in params]
    prompts = [row.prompt_token_ids if rep else () for row, rep in zip(rows, with_repetition)]
    outputs = [row.output_token_ids if p.has_penalties else () for row, p in zip(rows, params)]
    prompt_len = max(len(t) for t in prompts)
    output_len = max(len(t) for t in outputs)
    tokens = np.full((len(rows), prompt_len + output_len), vocab_size, dtype=np.int64)
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        tokens[i, :len(prompt)] = prompt
        tokens[i, prompt_len:prompt_len + len(output)] = output
    if tokens.size and (tokens.min() < 0 or tokens.max() > vocab_size):
        raise ValueError(f"token ids for penalties must be in [0, {vocab_size}), "
                         f"got min {tokens.min()} max {tokens.max()}")
    factors = torch.tensor([[p.repetition_penalty for p in params],
                            [p.frequency_penalty for p in params],
                            [p.presence_penalty for p in params]], dtype=torch.float32)
    factors = _to_device(factors, device).unsqueeze(2)
    return PenaltyTokens(
        tokens=_to_device(torch.from_numpy(tokens), device),
        prompt_len=prompt_len,
        repetition=factors[0] if any(with_repetition) else None,
        frequency=factors[1] if any(p.frequency_penalty != 0.0 for p in params) else None,
        presence=factors[2] if any(p.presence_penalty != 0.0 for p in params) else None,
    )


def _min_tokens_block(rows: Sequence[SamplingRow], vocab_size: int, eos_token_ids: Sequence[int],
                      device: torch.device) -> Optional[torch.Tensor]:
    """(row, token) pairs that may not be sampled yet: stop tokens before min_tokens."""
    pairs: list[tuple[int, int]] = []
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) >= p.min_tokens:
            continue
        blocked = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            blocked.update(eos_token_ids)
        pairs.extend((i, t) for t in sorted(blocked) if t < vocab_size)
    if not pairs:
        return None
    return _to_device(torch.tensor(pairs, dtype=torch.int64).T.contiguous(), device)


def _logits_processors(rows: Sequence[SamplingRow], vocab_size: int,
                       device: torch.device) -> LogitsProcessors:
    allowed_rows: list[int] = []
    allowed: list[tuple[int, int]] = []
    banned: list[tuple[int, int]] = []
    bias_index: list[tuple[int, int]] = []
    bias: list[float] = []
    for i, row in enumerate(rows):
        p = row.params
        if p.allowed_token_ids is not None:
            allowed_rows.append(i)
            allowed.extend((i, t) for t in set(p.allowed_token_ids) if t < vocab_size)
        for word in p.bad_words_token_ids or ():
            # The word's last token is banned once the output ends with the rest of it.
            *prefix, last = word
            if last < vocab_size and (not prefix or list(row.output_token_ids[-len(prefix):]) == prefix):
                banned.append((i, last))
        for t, b in (p.logit_bias or {}).items():
            if t < vocab_size:
                bias_index.append((i, t))
                bias.append(b)

    def pairs(items: list[tuple[int, int]]) -> Optional[torch.Tensor]:
        if not items:
            return None
        return _to_device(torch.tensor(items, dtype=torch.int64).T.contiguous(), device)
    return LogitsProcessors(
        allowed_rows=_to_device(torch.tensor(allowed_rows, dtype=torch.int64), device) if allowed_rows else None,
        allowed=pairs(allowed), banned=pairs(banned), bias_index=pairs(bias_index),
        bias=_to_device(torch.tensor(bias, dtype=torch.float32), device) if bias else None)


def _seeded_samples(rows: Sequence[SamplingRow]) -> list[SeededSamples]:
    seeded = []
    start = 0
    for row in rows:
        if row.generator is not None and not row.params.greedy:
            seeded.append(SeededSamples(start, row.num_samples, row.generator))
        start += row.num_samples
    return seeded


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return host
    # Pinned staging lets the copy overlap with the host work that follows it.
    return host.pin_memory().to(device, non_blocking=True)
