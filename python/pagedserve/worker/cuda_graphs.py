"""CUDA graphs for decode steps and small one-sequence prefills.

A decode step (every row brings one token) runs the same kernels whatever the
batch's contents, so the forward is captured once per batch size in a ladder
(1, 2, 4, 8, then every 16 up to max_num_seqs) over the StepInputs device
views, and replayed: a step of S sequences replays the smallest captured size
>= S, with rows past S padded (no KV write, empty context). The attention
kernels read lengths and block tables from device memory, but size their
split-K grid (and whether a reduce kernel follows) from the host's bound on
the context, fixed at capture. One capture for max_model_len serves every
step, but then short contexts pay the longest one's grid: SmolLM2 at its own
8192 tokens ran 16 partitions a row at batch 64, nearly all empty, and a
reduce kernel per layer. So each batch size is captured for context bounds in
a ladder too (256, 1024, 4096, ... and max_model_len; 256 tokens is one
partition at any batch, decode_attention.cuh), and a step replays the graph
of the smallest bound >= its longest context. H200, SmolLM2 shape, 64
concurrent, 24 in / 150 out: 34.8-45.4k -> 48.0-50.0k tok/s. The cost, for
SmolLM2 at max_num_seqs 256 (80 decode graphs instead of 20): ~1 s more
start-up and ~10 MiB of device memory (bench/results/h200/session25.md); each
graph keeps its own output rows, so the memory grows with the hidden size and
the number of bounds (an 8B model at 128k tokens: 6 bounds, ~100 MiB).

A step that is one sequence's prefill of n <= PREFILL_GRAPH_TOKENS tokens (a
prompt on an idle engine: a chat turn, a single stream, the chunks of a long
prompt) replays a graph captured for exactly n tokens: eager, such a step is
bound by the host's ~200 kernel launches. Exact counts need no padding tokens,
which would sit inside the sequence's causal attention; the prefill kernels'
grid follows n (max_query_len), and what they attend to (seq_lens, block
tables) comes from device memory. H200, TinyLlama shape, 10 requests of 24 in
/ 150 out in turn, interleaved: 838 / 952 / 952 vs 838 / 930 / 927 tok/s
without (bench/results/h200/session19.md).
"""

from __future__ import annotations

import bisect
import gc
import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from pagedserve.worker.step_inputs import StepInputs

logger = logging.getLogger("pagedserve")


# One-sequence prefills of up to this many tokens replay a graph of their count: the dense range the
# start-up warm-up runs (prefill_warmup.DENSE_WARMUP_TOKENS); capturing them adds ~1 s to start-up.
PREFILL_GRAPH_TOKENS = 64


# The context bounds' ladder: the first is one decode partition at any batch (decode_attention.cuh's
# kMinPartitionTokens); each next one 4x longer, so a step's grid is at most 4x its context's.
FIRST_CONTEXT_BOUND = 256
CONTEXT_BOUND_GROWTH = 4


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


def context_bound_ladder(max_seq_len: int) -> list[int]:
    """The context bounds decode graphs are captured for: 256, 1024, 4096, ... below max_seq_len, then it."""
    bounds, bound = [], FIRST_CONTEXT_BOUND
    while bound < max_seq_len:
        bounds.append(bound)
        bound *= CONTEXT_BOUND_GROWTH
    return bounds + [max_seq_len]


@dataclass
class CapturedStep:
    batch_size: int  # the rows prepare_replay fills: a decode batch's padded size, 1 for a prefill
    context_bound: int  # the attention's host bound on a row's context (max_seq_len of the captured views)
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # the graph's output, overwritten by each replay
    launching: threading.Lock  # held while the host launches the graph (see CudaGraphs.abandon)
    destroyed: bool = False

    def replay(self) -> torch.Tensor:
        with self.launching:
            if self.destroyed:
                raise RuntimeError("the CUDA graphs were destroyed (a tensor-parallel peer died)")
            self.graph.replay()
        return self.hidden


class CudaGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, inputs: StepInputs, max_num_seqs: int, max_seq_len: int,
                 prefill_tokens: int = 0):
        """prefill_tokens: capture one-sequence prefills of 1..prefill_tokens tokens too (bounded here by
        the step's token budget and max_seq_len)."""
        self.sizes = batch_size_ladder(max_num_seqs)
        self.context_bounds = context_bound_ladder(max_seq_len)
        self.prefill_counts = list(range(1, min(prefill_tokens, inputs.max_num_tokens, max_seq_len) + 1))
        self._decode: dict[tuple[int, int], CapturedStep] = {}  # by (batch size, context bound)
        self._prefill: dict[int, CapturedStep] = {}
        self._launching = threading.Lock()
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # No garbage collection while capturing: a collected CUDA tensor (e.g. of an engine this process
        # dropped) freed mid-capture invalidates it ("operation failed due to a previous error during
        # capture", seen on an H100 with several engines in one process).
        gc.collect()
        gc.disable()
        try:
            inputs.fill_capture_batch(max_num_seqs)
            for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
                for bound in reversed(self.context_bounds):
                    views = inputs.decode_views(bs, bound)
                    self._decode[bs, bound] = self._capture(model, kv_cache, views, bs, pool, self._launching)
            for n in reversed(self.prefill_counts):
                inputs.fill_capture_prefill(n)
                views = inputs.prefill_views(n, max_seq_len)
                self._prefill[n] = self._capture(model, kv_cache, views, 1, pool, self._launching)
        finally:
            gc.enable()
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch %d..%d x contexts up to %s) and %d one-sequence "
                    "prefill graphs in %.1f s", len(self._decode), self.sizes[0], self.sizes[-1],
                    "/".join(map(str, self.context_bounds)), len(self.prefill_counts), time.perf_counter() - start)
        # The smallest captured size >= S, for every S.
        self._size_for = np.zeros(max_num_seqs + 1, dtype=np.int64)
        for s in range(1, max_num_seqs + 1):
            self._size_for[s] = next(b for b in self.sizes if b >= s)

    @staticmethod
    def _capture(model, kv_cache, views, batch_size: int, pool, launching: threading.Lock) -> CapturedStep:
        input_ids, positions, attn = views
        model.forward(input_ids, positions, attn, kv_cache)  # warm up: library handles, autotuning
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = model.forward(input_ids, positions, attn, kv_cache)
        return CapturedStep(batch_size, attn.max_seq_len, graph, hidden, launching)

    def release(self) -> None:
        """Destroys the graphs (NCCL waits for the graphs that captured a communicator before destroying
        it: tensor-parallel shutdown hung on them); lookups find none afterwards."""
        torch.cuda.synchronize()
        self._destroy()
        self._decode.clear()
        self._prefill.clear()
        self._size_for = np.zeros(1, dtype=np.int64)

    def abandon(self) -> None:
        """Destroys the graphs without waiting for the device, from any thread: after a tensor-parallel
        peer died, a replay sits in a collective that only an abort of the communicators ends, and NCCL's
        abort in turn waits until every graph that captured them is destroyed. CUDA frees a graph that is
        still executing when it completes; the lock keeps the destroy out of a launch in progress, and a
        later replay raises."""
        self._destroy()

    def _destroy(self) -> None:
        with self._launching:
            for captured in [*self._decode.values(), *self._prefill.values()]:
                if not captured.destroyed:
                    captured.destroyed = True
                    captured.graph.reset()

    def lookup(self, step) -> Optional[CapturedStep]:
        """The graph that runs `step`, or None (run it eagerly)."""
        n = step.num_seqs
        if n == 1 and step.num_decodes == 0:
            return self._prefill.get(int(step.num_tokens))
        if n == 0 or step.num_decodes != n or step.num_tokens != n or n >= len(self._size_for):
            return None
        bound = self.context_bound(int(step.max_seq_len))
        return None if bound is None else self._decode[int(self._size_for[n]), bound]

    def context_bound(self, context: int) -> Optional[int]:
        """The smallest captured context bound >= context (None past max_seq_len: run it eagerly)."""
        at = bisect.bisect_left(self.context_bounds, context)
        return self.context_bounds[at] if at < len(self.context_bounds) else None
