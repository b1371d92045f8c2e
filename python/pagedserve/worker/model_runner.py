"""ModelRunner: executes one scheduled step on the model's device.

The scheduler decides, the runner executes: apply the step's copy-on-write
block copies to the KV cache, move the step's index arrays to the device, run
the forward (a CUDA-graph replay for decode batches on CUDA), compute logits
for the rows that sample, and sample them.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from pagedserve import ops
from pagedserve.sample.sampler import PendingSamples, Sampler
from pagedserve.worker.step_inputs import StepInputs


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

    @torch.inference_mode()
    def execute_async(self, step, rows, grammar=None) -> PendingSamples:
        """Queues `step` (a _core.StepOutput, or any object with its fields) and the sampling of
        `rows` (one SamplingRow per sample row) on the device; the result arrives with
        PendingSamples.result(). `grammar`: the sampler's token mask, or a callable returning it."""
        with _torch_threads(self.torch_threads):
            if step.block_copies.shape[0]:
                copies = torch.from_numpy(step.block_copies.copy()).to(self.device, non_blocking=True)
                ops.copy_blocks(self.kv_cache, copies)
            logits = self.compute_logits(step)
            if callable(grammar):  # the structured-output mask: filled on the host while the device runs the forward
                grammar = grammar()
            return self.sampler.launch(logits, rows, grammar)

    def compute_logits(self, step) -> torch.Tensor:
        graph = self.graphs.lookup(step) if self.graphs is not None else None
        if graph is not None:
            _, _, _, logits_indices = self.inputs.prepare(step, padded_num_seqs=graph.batch_size)
            hidden = graph.replay()
        else:
            input_ids, positions, attn, logits_indices = self.inputs.prepare(step)
            hidden = self.model.forward(input_ids, positions, attn, self.kv_cache)
        return self.model.compute_logits(hidden[logits_indices.long()])


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
