"""The step with the most activations, as plain step arrays.

Sizing the KV cache on a GPU runs this step once and measures its peak memory
(worker/memory_budget.py). It is built with the same fields as the scheduler's
_core.StepOutput and executed by a ModelRunner through StepInputs like every
real step, so the profile sees exactly the tensors a real step allocates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pagedserve.sample.sampling_tensors import SamplingRow
from pagedserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class StepArrays:
    """The fields of _core.StepOutput that StepInputs and ModelRunner read."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    prompt_lens: np.ndarray
    logits_indices: np.ndarray
    block_tables: np.ndarray  # [num_seqs, max_blocks_per_seq]
    block_copies: np.ndarray  # [num_copies, 2]
    max_query_len: int
    max_seq_len: int
    num_decodes: int = 0
    # Inputs still on the device (run-ahead, cpp/step_output.h): none in a step built here.
    deferred_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    deferred_samples: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_tables.shape[1]


def worst_case_step(num_tokens: int, max_model_len: int, block_size: int, num_logit_rows: int,
                    vocab_size: int) -> StepArrays:
    """A full token budget of prefill, cut into sequences of at most max_model_len tokens that each
    start at position 0 in blocks of their own (numbered from 0), with logits for num_logit_rows rows."""
    per_seq = min(num_tokens, max_model_len)
    lens = [min(per_seq, num_tokens - start) for start in range(0, num_tokens, per_seq)]
    blocks_per_seq = math.ceil(per_seq / block_size)
    block_tables = np.arange(len(lens) * blocks_per_seq, dtype=np.int32).reshape(len(lens), blocks_per_seq)
    seq_positions = [np.arange(n, dtype=np.int32) for n in lens]
    slots = [block_tables[i, pos // block_size] * block_size + pos % block_size for i, pos in enumerate(seq_positions)]
    rng = np.random.default_rng(0)
    return StepArrays(
        input_ids=rng.integers(0, vocab_size, num_tokens, dtype=np.int32),
        positions=np.concatenate(seq_positions),
        slot_mapping=np.concatenate(slots).astype(np.int32),
        query_start_loc=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
        seq_lens=np.asarray(lens, dtype=np.int32),
        prompt_lens=np.asarray(lens, dtype=np.int32),
        logits_indices=np.arange(min(num_logit_rows, num_tokens), dtype=np.int32),
        block_tables=block_tables,
        block_copies=np.zeros((0, 2), dtype=np.int32),
        max_query_len=per_seq,
        max_seq_len=per_seq,
    )


def worst_case_rows(num_rows: int) -> list[SamplingRow]:
    """Sampling rows that take the sampler's most expensive path (penalties, top-k and top-p)."""
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.1)
    return [SamplingRow(params, 1, [1, 2, 3], [4], None)] * num_rows
