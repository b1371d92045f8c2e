"""Prompt logprobs: the raw log-probability of each next prompt token, and the top-N, per prompt position.

The engine (engine/prompt_logprobs.py) decides which positions of a prefill step need them; the model
runner hands the hidden states of those positions here. The LM head runs over those rows only, in
slices (a long prompt's [T, V] logits would otherwise be the step's largest tensor), and the
log_softmax is taken in float32 over the unprocessed logits, as the sampler's logprobs are.
The results reach the host in one copy (PendingSamples.copy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from pagedserve.sample.sampler import PendingSamples, SampleLogprobs

# Rows of logits computed at once: bounds the [rows, V] float32 temporaries.
_ROWS_PER_SLICE = 256


@dataclass
class Recompute:
    """Prompt positions [begin, end) of one sequence whose KV is in its blocks (a prefix-cache hit) but
    whose hidden states this step does not compute: the runner runs them again, writing no KV."""

    token_ids: list[int]  # the sequence's tokens [begin, end)
    begin: int
    block_table: np.ndarray  # the sequence's row of the step's block tables
    prompt_len: int = 0  # the sequence's prompt length: picks length-dependent rope rows


@dataclass
class PromptLogprobsPlan:
    """What one step computes. Result rows: the recomputed positions (in `recompute` order), then
    `step_rows` (indices into the step's tokens); `targets` is the next prompt token of each row."""

    top_n: int
    targets: list[int] = field(default_factory=list)
    step_rows: list[int] = field(default_factory=list)
    recompute: list[Recompute] = field(default_factory=list)


def launch(plan: PromptLogprobsPlan, model, hidden_rows: torch.Tensor, vocab_size: int) -> Optional[PendingSamples]:
    """Queues the logprobs of `hidden_rows` ([len(plan.targets), H], the plan's rows in order) on the
    device; result() gives one SampleLogprobs per row. None on a tensor-parallel rank other than the
    driver: it joins each slice's compute_logits (a gather to the driver) and computes nothing more."""
    device = hidden_rows.device
    targets = torch.tensor(plan.targets, dtype=torch.int64).to(device, non_blocking=True)
    parts = []
    for start in range(0, hidden_rows.shape[0], _ROWS_PER_SLICE):
        rows = slice(start, start + _ROWS_PER_SLICE)
        logits = model.compute_logits(hidden_rows[rows])
        if logits is None:
            continue
        logprobs = logits[:, :vocab_size].float().log_softmax(dim=-1)
        chosen = logprobs.gather(1, targets[rows].unsqueeze(1))
        ranks = (logprobs > chosen).sum(dim=-1, keepdim=True).to(torch.int32) + 1
        top_values, top_ids = logprobs.topk(plan.top_n, dim=-1)
        parts.append(torch.cat([chosen.view(torch.int32), ranks, top_ids.to(torch.int32),
                                top_values.view(torch.int32)], dim=1))
    if not parts and hidden_rows.shape[0]:
        return None
    packed = torch.cat(parts) if parts else torch.empty(0, 2 + 2 * plan.top_n, dtype=torch.int32, device=device)
    return PendingSamples.copy(packed, lambda host: _unpack(host, plan))


def _unpack(host: np.ndarray, plan: PromptLogprobsPlan) -> list[SampleLogprobs]:
    n = plan.top_n
    chosen = host[:, 0].view(np.float32).tolist()
    ranks = host[:, 1].tolist()
    top_ids = host[:, 2:2 + n].tolist()
    top_values = np.ascontiguousarray(host[:, 2 + n:]).view(np.float32).tolist()
    return [SampleLogprobs(target, chosen[i], ranks[i], list(zip(top_ids[i], top_values[i])))
            for i, target in enumerate(plan.targets)]
