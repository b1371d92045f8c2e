"""ModelRunner: executes one scheduled step on the model's device.

The scheduler decides, the runner executes: apply the step's copy-on-write
block copies to the KV cache, move the step's index arrays to the device, run
the forward (a CUDA-graph replay for decode batches on CUDA), compute logits
for the rows that sample, and sample them.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import numpy as np
import torch

from pagedserve import ops
from pagedserve.models.attention_metadata import AttentionMetadata
from pagedserve.sample import prompt_logprobs
from pagedserve.sample.sampler import PendingSamples, Sampler
from pagedserve.worker.heap_trim import HeapTrimmer
from pagedserve.worker.step_inputs import PAD_SLOT, StepInputs


class ModelRunner:
    def __init__(self, model, kv_cache: torch.Tensor, sampler: Sampler, inputs: StepInputs, *,
                 graphs=None, torch_threads: Optional[int] = None):
        """graphs: CudaGraphs over the same model, KV cache and inputs, or None (eager).
        torch_threads: torch's intra-op threads during a step (None: leave torch's setting). On a CPU
        whose heavy math runs in our ops' own pool, torch's spin-waiting OpenMP workers only compete
        with that pool for the same cores."""
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = kv_cache.device
        self.inputs = inputs
        self.graphs = graphs
        self.torch_threads = torch_threads
        self.heap = HeapTrimmer(enabled=self.device.type == "cpu")  # freed activations back to the OS

    @torch.inference_mode()
    def execute_async(self, step, rows, grammar=None, prompt_plan=None,
                      last_ids: Optional[torch.Tensor] = None) -> Optional[PendingSamples]:
        """Queues `step` (a _core.StepOutput, or any object with its fields) and the sampling of
        `rows` (one SamplingRow per sample row, or a callable returning them) on the device; the result
        arrives with PendingSamples.result(). `grammar`: the sampler's token mask or mask source (see
        Sampler.launch), or a callable returning it. Callables are called once the forward is queued, rows first.
        `prompt_plan` (sample.prompt_logprobs.PromptLogprobsPlan, prefill steps only): the prompt
        logprobs to compute too; they arrive with the result's `prompt_logprobs.result()`.
        `last_ids`: the previous step's PendingSamples.device_ids, where the engine ran ahead of it (the
        step's deferred input ids are among them).
        A tensor-parallel rank other than the driver runs the same model calls (and so the same
        collectives) and returns None: its model hands it no logits to sample."""
        self.heap.note_step(int(step.num_tokens))
        with _torch_threads(self.torch_threads):
            if step.block_copies.shape[0]:
                copies = torch.from_numpy(step.block_copies.copy()).to(self.device, non_blocking=True)
                ops.copy_blocks(self.kv_cache, copies)
            logits, prompt_pending = self._forward(step, prompt_plan, last_ids)
            if logits is None:
                return None
            if callable(rows):  # made on the host while the device runs the forward
                rows = rows()
            if callable(grammar):  # the structured-output grammars: made on the host while the device runs the forward
                grammar = grammar()
            pending = self.sampler.launch(logits, rows, grammar)
            pending.prompt_logprobs = prompt_pending
            return pending

    def compute_logits(self, step) -> torch.Tensor:
        return self._forward(step)[0]

    def _forward(self, step, prompt_plan=None, last_ids=None) -> tuple[torch.Tensor, Optional[PendingSamples]]:
        """The logits of the step's sample rows, and the pending prompt logprobs of `prompt_plan`."""
        graph = self.graphs.lookup(step) if self.graphs is not None and prompt_plan is None else None
        if graph is not None:
            logits_indices = self.inputs.prepare_replay(step, graph.batch_size, last_ids)
            hidden = graph.replay()
        else:
            input_ids, positions, attn, logits_indices = self.inputs.prepare(step, last_ids)
            hidden = self.model.forward(input_ids, positions, attn, self.kv_cache)
        logits = self.model.compute_logits(_logit_rows(hidden, logits_indices))
        if prompt_plan is None:
            return logits, None
        step_rows = hidden[torch.tensor(prompt_plan.step_rows, dtype=torch.int64).to(self.device)]
        rows = [self._recompute_hidden(r) for r in prompt_plan.recompute] + [step_rows]
        return logits, prompt_logprobs.launch(prompt_plan, self.model, torch.cat(rows), self.sampler.vocab_size)

    def _recompute_hidden(self, r: "prompt_logprobs.Recompute") -> torch.Tensor:
        """The hidden states of prompt positions whose KV the prefix cache supplied: a forward over them
        that reads their KV from the sequence's blocks and writes none, in slices of the step's token
        budget."""
        parts, table = [], torch.from_numpy(np.ascontiguousarray(r.block_table, dtype=np.int32))
        table = table.view(1, -1).to(self.device)
        for start in range(0, len(r.token_ids), self.inputs.max_num_tokens):
            ids = r.token_ids[start:start + self.inputs.max_num_tokens]
            end = r.begin + start + len(ids)
            attn = AttentionMetadata(
                slot_mapping=torch.full((len(ids),), PAD_SLOT, dtype=torch.int32, device=self.device),
                block_tables=table, query_start_loc=torch.tensor([0, len(ids)], dtype=torch.int32).to(self.device),
                seq_lens=torch.tensor([end], dtype=torch.int32).to(self.device), max_query_len=len(ids),
                max_seq_len=end, num_decodes=0, workspace=self.inputs.workspace,
                prompt_lens=torch.tensor([r.prompt_len], dtype=torch.int32).to(self.device))
            positions = torch.arange(end - len(ids), end, dtype=torch.int32).to(self.device)
            ids_t = torch.tensor(ids, dtype=torch.int32).to(self.device)
            parts.append(self.model.forward(ids_t, positions, attn, self.kv_cache))
        return torch.cat(parts)


def _logit_rows(hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
    """The hidden states of the tokens that sample. The scheduler lists each sampling row's last token in row
    order (cpp/scheduler.cc), so as many indices as tokens means every token in order (a decode batch): the
    hidden states themselves, without a gather (about 15 us of a CPU step)."""
    if logits_indices.shape[0] == hidden.shape[0]:
        return hidden
    return hidden[logits_indices.long()]


@contextlib.contextmanager
def _torch_threads(num_threads: Optional[int]) -> Iterator[None]:
    """Runs the block with torch.set_num_threads(num_threads), then restores the caller's setting."""
    before = torch.get_num_threads()
    if num_threads is None or num_threads == before:
        yield
        return
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
