"""Drives a model the way the engine does, for tests: a block pool handed out in
random order, and steps that mix decodes (first) with prefill chunks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pagedserve.models.attention_metadata import AttentionMetadata

PAD_BLOCK = 0  # step_output.h kPadBlock


@dataclass
class _Sequence:
    token_ids: list[int]
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)


class PagedBatchRunner:
    """Owns a NaN-poisoned KV cache (any read of an unwritten slot shows up in the logits)."""

    def __init__(self, model, block_size: int = 4, num_blocks: int = 64, seed: int = 0,
                 index_dtype: torch.dtype = torch.int32):
        config = model.config
        self.model = model
        self.block_size = block_size
        self.index_dtype = index_dtype
        device = next(model.parameters()).device
        self.device = device
        self.kv_cache = torch.full((config.num_layers, 2, num_blocks, config.num_kv_heads, block_size,
                                    config.head_dim), float("nan"), dtype=config.dtype, device=device)
        generator = torch.Generator().manual_seed(seed)
        self.free_blocks = torch.randperm(num_blocks, generator=generator).tolist()
        self.sequences: dict[str, _Sequence] = {}

    def add(self, name: str, token_ids: list[int]) -> None:
        self.sequences[name] = _Sequence(list(token_ids))

    def append(self, name: str, token_id: int) -> None:
        """Extends a sequence, e.g. with the token just sampled from its logits."""
        self.sequences[name].token_ids.append(token_id)

    def step(self, chunks: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
        """Runs the next n tokens of each named sequence in one forward; returns their float32 logits [n, vocab]."""
        chunks = sorted(chunks, key=lambda chunk: chunk[1] != 1)  # decode rows first, as the scheduler orders them
        input_ids, positions, slots, query_start_loc, seq_lens = [], [], [], [0], []
        for name, count in chunks:
            seq = self.sequences[name]
            start, end = seq.num_computed, seq.num_computed + count
            assert end <= len(seq.token_ids), f"{name} has only {len(seq.token_ids)} tokens"
            self._grow(seq, end)
            input_ids += seq.token_ids[start:end]
            positions += list(range(start, end))
            slots += [self._slot(seq, p) for p in range(start, end)]
            query_start_loc.append(query_start_loc[-1] + count)
            seq_lens.append(end)
            seq.num_computed = end
        attn = self._metadata(chunks, slots, query_start_loc, seq_lens)
        ids = torch.tensor(input_ids, dtype=self.index_dtype, device=self.device)
        pos = torch.tensor(positions, dtype=self.index_dtype, device=self.device)
        hidden = self.model.forward(ids, pos, attn, self.kv_cache)
        logits = self.model.compute_logits(hidden)
        return {name: logits[query_start_loc[row]:query_start_loc[row + 1]] for row, (name, _) in enumerate(chunks)}

    def _grow(self, seq: _Sequence, length: int) -> None:
        while len(seq.blocks) * self.block_size < length:
            seq.blocks.append(self.free_blocks.pop())

    def _slot(self, seq: _Sequence, position: int) -> int:
        return seq.blocks[position // self.block_size] * self.block_size + position % self.block_size

    def _metadata(self, chunks, slots, query_start_loc, seq_lens) -> AttentionMetadata:
        max_blocks = max(math.ceil(length / self.block_size) for length in seq_lens)
        tables = [self.sequences[name].blocks + [PAD_BLOCK] * (max_blocks - len(self.sequences[name].blocks))
                  for name, _ in chunks]
        int32 = dict(dtype=torch.int32, device=self.device)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, **int32),
            block_tables=torch.tensor(tables, **int32),
            query_start_loc=torch.tensor(query_start_loc, **int32),
            seq_lens=torch.tensor(seq_lens, **int32),
            max_query_len=max(count for _, count in chunks),
            max_seq_len=max(seq_lens),
            num_decodes=sum(1 for _, count in chunks if count == 1),
        )


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()
