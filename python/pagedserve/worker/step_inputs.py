"""StepInputs: the scheduler's flat int32 arrays moved to the model's device.

All per-step index arrays live in ONE host buffer at fixed offsets (pinned
memory on CUDA) and reach the device in ONE copy; the device-side tensors are
views at the same offsets. The offsets and capacities never change, so CUDA
graphs captured over these views see each new step's values in place.

The host buffer is written again only once the device has read it: the copy
is queued behind the steps still running, and a step that samples nothing (a
middle chunk of a chunked prefill) returns to the host before its copy has run,
so without the wait the next step's arrays could reach the device as this
step's (seen on an H200: NaN outputs of a Mixtral-shaped model whose prompt
chunks replayed CUDA graphs, which leave the host ahead of the device).

The decode rows also get a launch order, longest context first
(`decode_order`, cuda/cuda_ops.h): a batch of mixed contexts then ends with
its short rows filling the CUDA kernel's last wave. The CPU kernel ignores
it: its work plan sorts its own items by cost (cpp/ops/paged_attention.cc).

When the engine runs ahead, some input ids are the previous step's samples,
still on the device: the step names them (deferred_tokens / deferred_samples,
cpp/scheduler.h) and prepare() gathers them into input_ids after the
copy, in stream order, before the forward reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from pagedserve.models.attention_metadata import AttentionMetadata

PAD_SLOT = -1  # cpp/ops/kv_cache_layout.h kPadSlot: writers skip it


@dataclass
class _Segment:
    offset: int
    capacity: int


class StepInputs:
    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 workspace: Optional[torch.Tensor] = None):
        """workspace: the attention kernels' split-K scratch (CUDA), handed to every step's metadata."""
        self.device = device
        self.workspace = workspace
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        sizes = {
            "input_ids": max_num_tokens,
            "positions": max_num_tokens,
            "slot_mapping": max_num_tokens,
            "query_start_loc": max_num_seqs + 1,
            "seq_lens": max_num_seqs,
            "prompt_lens": max_num_seqs,
            "logits_indices": max_num_tokens,
            "deferred_tokens": max_num_seqs,  # a decode row's token at most
            "deferred_samples": max_num_seqs,
            "decode_order": max_num_seqs,
            "block_tables": max_num_seqs * max_blocks_per_seq,  # last: copied only as far as used
        }
        self._segments: dict[str, _Segment] = {}
        offset = 0
        for name, size in sizes.items():
            self._segments[name] = _Segment(offset, size)
            offset += size
        pin = device.type == "cuda"
        self._host = torch.zeros(offset, dtype=torch.int32, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._device = self._host if device.type == "cpu" else torch.zeros(offset, dtype=torch.int32, device=device)
        self._copied = torch.cuda.Event() if pin else None  # recorded after each copy of the host buffer
        self.block_tables = self._view("block_tables").view(max_num_seqs, max_blocks_per_seq)
        self._logits_views: dict[int, torch.Tensor] = {}

    def _view(self, name: str) -> torch.Tensor:
        seg = self._segments[name]
        return self._device[seg.offset:seg.offset + seg.capacity]

    def _host_view(self, name: str) -> np.ndarray:
        seg = self._segments[name]
        return self._host_np[seg.offset:seg.offset + seg.capacity]

    def prepare(self, step, last_ids: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Copies the step to the device for an eager forward (`last_ids`: the previous step's device-side
        samples, where the engine ran ahead of it). Returns (input_ids, positions, attn, logits_indices)."""
        num_logits = self._fill(step, step.num_seqs, last_ids)
        attn = self._metadata(step.num_seqs, step.num_tokens, step.max_query_len, step.max_seq_len,
                              step.num_decodes)
        return (self._view("input_ids")[:step.num_tokens], self._view("positions")[:step.num_tokens], attn,
                self.logits_indices(num_logits))

    def prepare_replay(self, step, padded_num_seqs: int, last_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Copies a decode-only step to the device for a CUDA graph captured at padded_num_seqs rows (its
        views are the graph's; rows past the step are padding that writes no KV and attends to nothing;
        `last_ids` as in prepare). Returns logits_indices. No views are built: ~8 tensor slices, ~30 us of
        a step's host time."""
        return self.logits_indices(self._fill(step, padded_num_seqs, last_ids))

    def logits_indices(self, num_logits: int) -> torch.Tensor:
        """The device view of the first num_logits logits indices (made once per count)."""
        view = self._logits_views.get(num_logits)
        if view is None:
            view = self._logits_views[num_logits] = self._view("logits_indices")[:num_logits]
        return view

    def _fill(self, step, rows: int, last_ids: Optional[torch.Tensor]) -> int:
        """The step's arrays (padded to `rows` one-token rows) into the host buffer, then one copy of the
        used part to the device, then the deferred input ids. Returns the number of logits indices."""
        num_seqs, num_tokens = step.num_seqs, step.num_tokens
        if num_tokens > self.max_num_tokens or num_seqs > self.max_num_seqs or rows > self.max_num_seqs:
            raise ValueError(f"step of {num_tokens} tokens / {num_seqs} seqs exceeds the runner's buffers")
        if self._copied is not None:
            self._copied.synchronize()  # the last copy has read the host buffer (returns at once if never recorded)
        h = self._host_view
        h("input_ids")[:num_tokens] = step.input_ids
        h("positions")[:num_tokens] = step.positions
        h("slot_mapping")[:num_tokens] = step.slot_mapping
        h("query_start_loc")[:num_seqs + 1] = step.query_start_loc
        h("seq_lens")[:num_seqs] = step.seq_lens
        h("prompt_lens")[:num_seqs] = step.prompt_lens
        num_logits = len(step.logits_indices)
        h("logits_indices")[:num_logits] = step.logits_indices
        num_deferred = len(step.deferred_tokens)
        if num_deferred:
            h("deferred_tokens")[:num_deferred] = step.deferred_tokens
            h("deferred_samples")[:num_deferred] = step.deferred_samples
        if rows > num_seqs:  # padding rows of a decode batch: one token each
            tokens = num_tokens + rows - num_seqs
            h("input_ids")[num_tokens:tokens] = 0
            h("positions")[num_tokens:tokens] = 0
            h("slot_mapping")[num_tokens:tokens] = PAD_SLOT
            h("query_start_loc")[num_seqs + 1:rows + 1] = np.arange(num_tokens + 1, tokens + 1)
            h("seq_lens")[num_seqs:rows] = 0
            h("prompt_lens")[num_seqs:rows] = 0
        num_decodes = step.num_decodes + rows - num_seqs  # padding rows are decode rows
        h("decode_order")[:num_decodes] = np.argsort(-h("seq_lens")[:num_decodes], kind="stable")
        width = step.max_blocks_per_seq
        bt = h("block_tables").reshape(self.max_num_seqs, self.max_blocks_per_seq)
        bt[:num_seqs, :width] = step.block_tables
        used = self._segments["block_tables"].offset + rows * self.max_blocks_per_seq
        if self._copied is not None:
            self._device[:used].copy_(self._host[:used], non_blocking=True)
            self._copied.record()
        if num_deferred:
            self._take_deferred(num_deferred, last_ids)
        return num_logits

    def _take_deferred(self, num_deferred: int, last_ids: Optional[torch.Tensor]) -> None:
        """Puts the previous step's device-side samples (`last_ids`, int32, one per sample) where the step's
        deferred input ids go, after the copy (stream order), before the forward."""
        if last_ids is None:
            raise RuntimeError("the step takes input ids from the previous step's samples, which were not given")
        tokens = self._view("deferred_tokens")[:num_deferred]
        samples = self._view("deferred_samples")[:num_deferred]
        self._view("input_ids").index_put_((tokens,), last_ids.index_select(0, samples))

    def _metadata(self, rows: int, tokens: int, max_query_len: int, max_seq_len: int,
                  num_decodes: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self._view("slot_mapping")[:tokens],
            block_tables=self.block_tables[:rows],
            query_start_loc=self._view("query_start_loc")[:rows + 1],
            seq_lens=self._view("seq_lens")[:rows],
            prompt_lens=self._view("prompt_lens")[:rows],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            num_decodes=num_decodes,
            workspace=self.workspace,
            decode_order=self._view("decode_order")[:num_decodes] if num_decodes else None,
        )

    def decode_views(self, rows: int, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, attn) over the first `rows` rows of a decode batch: what a CUDA graph
        captures, and what prepare_replay(step, rows) later fills in place."""
        return (self._view("input_ids")[:rows], self._view("positions")[:rows],
                self._metadata(rows, rows, 1, max_seq_len, rows))

    def prefill_views(self, num_tokens: int, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                         AttentionMetadata]:
        """(input_ids, positions, attn) of one sequence bringing num_tokens tokens: what a prefill CUDA graph
        captures, and what prepare_replay(step, 1) later fills in place."""
        return (self._view("input_ids")[:num_tokens], self._view("positions")[:num_tokens],
                self._metadata(1, num_tokens, num_tokens, max_seq_len, 0))

    def fill_capture_prefill(self, num_tokens: int) -> None:
        """A harmless one-sequence prefill for graph capture: num_tokens tokens at positions 0.., their
        context in block 0, written nowhere."""
        self._device.zero_()
        self._view("positions")[:num_tokens] = torch.arange(num_tokens, dtype=torch.int32, device=self._device.device)
        self._view("slot_mapping")[:num_tokens].fill_(PAD_SLOT)
        self._view("query_start_loc")[1] = num_tokens
        self._view("seq_lens")[0] = num_tokens
        self._view("prompt_lens")[0] = num_tokens

    def fill_capture_batch(self, rows: int) -> None:
        """A harmless decode batch for graph capture, which runs the kernels once: one-token contexts
        in block 0 that write nothing."""
        self._device.zero_()
        self._view("slot_mapping")[:rows].fill_(PAD_SLOT)
        self._view("query_start_loc")[:rows + 1] = torch.arange(rows + 1, dtype=torch.int32,
                                                                 device=self._device.device)
        self._view("seq_lens")[:rows].fill_(1)
        self._view("decode_order")[:rows] = torch.arange(rows, dtype=torch.int32, device=self._device.device)
