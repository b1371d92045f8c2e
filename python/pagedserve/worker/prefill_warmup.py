"""Start-up prefills of a ladder of token counts on a GPU, so that the first requests do not pay first uses.

Why: the first step of a token count the process has not run costs 5-9 ms more than later ones, once per
count, and the first request's first step ~30 ms more (H100, TinyLlama shape, first / second prefill of
a prompt right after start-up: 24 tokens 32-40 / 4.9-6.5 ms, 40 tokens 10-14 / 4.4-6.8, 100 tokens
10-15 / 4.4-6.8; bench/results/h100/session13.md). It follows the exact row count of the matrix
products (the library's per-shape kernel choice) more than module loading: with CUDA_MODULE_LOADING=EAGER
a new count still cost ~5 ms. At 150 output tokens that first step is about a sixth of a single
stream's time. With this ladder (every count from 1 to DENSE_WARMUP_TOKENS, then the powers of two to
LARGEST_WARMUP_PREFILL; 1.2-1.3 s at start-up) a 24- or 40-token prompt's first prefill took its
steady 5.8-6.4 ms, and the single-stream benchmark went from 603-667 to 732-778 tok/s.

Each count runs as one sequence (a prompt's prefill) and, up to max_num_seqs, as that many one-token
sequences that all sample: a ladder of the latter alone left a single 24-token prompt's first prefill at
24-25 ms (its long-query attention and one-row gather not yet run), and the LM head and sampler run over
one row per sampling sequence, a count of their own.

The steps run over the engine's model, KV cache and step inputs before any request exists (the worker
gives them a sampler of their own, so a seeded engine's streams start where they would), each sequence in
blocks numbered from 0 (worst_case_step's layout), whose KV the first requests' prefills overwrite like
any free block's; nothing is registered with the block pool or prefix cache. A CPU has no such
first-use cost: it runs nothing here.
"""

from __future__ import annotations

import logging
import time

from pagedserve.sample.sampling_tensors import SamplingRow
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.worst_case_step import StepArrays, worst_case_step

logger = logging.getLogger("pagedserve")

DENSE_WARMUP_TOKENS = 64  # every count up to this one: the prompts of chat turns and benchmarks
LARGEST_WARMUP_PREFILL = 512  # then powers of two up to this one; larger steps are compute-bound


def warmup_steps(num_tokens: int, max_num_seqs: int, block_size: int, vocab_size: int) -> list[StepArrays]:
    """The prefills of num_tokens tokens a warm-up runs: one sequence sampling one row (a prompt's prefill:
    the long-query attention, the gather of its last row, the products of num_tokens rows) and, for
    num_tokens up to max_num_seqs, num_tokens one-token sequences that all sample (the LM head and sampler
    over that many rows)."""
    steps = [worst_case_step(num_tokens, num_tokens, block_size, num_logit_rows=1, vocab_size=vocab_size)]
    if 1 < num_tokens <= max_num_seqs:
        steps.append(worst_case_step(num_tokens, 1, block_size, num_logit_rows=num_tokens, vocab_size=vocab_size))
    return steps


def prefill_warmup_sizes(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int, num_blocks: int,
                         block_size: int) -> list[int]:
    """1..DENSE_WARMUP_TOKENS, then powers of two up to LARGEST_WARMUP_PREFILL: the counts whose steps fit
    the step's token budget, the model length and the KV cache's blocks."""
    largest = min(LARGEST_WARMUP_PREFILL, max_num_batched_tokens, max_model_len)
    counts = sorted(set(range(1, DENSE_WARMUP_TOKENS + 1)) | {2**i for i in range(largest.bit_length())})

    def fits(n: int) -> bool:  # the blocks warmup_steps(n) lays out (its token ids do not matter here)
        return n <= largest and all(step.block_tables.size <= num_blocks
                                    for step in warmup_steps(n, max_num_seqs, block_size, vocab_size=1))
    return [n for n in counts if fits(n)]


def warm_up_prefills(runner, sizes: list[int], max_num_seqs: int, block_size: int, vocab_size: int) -> float:
    """Runs warmup_steps(n) for each n of `sizes` through `runner` (a ModelRunner over the engine's model and
    KV cache, before any request), every row greedy; returns the seconds it took."""
    start = time.perf_counter()
    greedy = SamplingRow(SamplingParams(temperature=0.0), 1, (), ())
    for n in sizes:
        for step in warmup_steps(n, max_num_seqs, block_size, vocab_size):
            pending = runner.execute_async(step, [greedy] * len(step.logits_indices))
            if pending is not None:  # None: a tensor-parallel rank other than the driver
                pending.result()
    seconds = time.perf_counter() - start
    if sizes:
        logger.info("warmed up %d prefill sizes (%d..%d tokens) in %.2f s", len(sizes), sizes[0], sizes[-1], seconds)
    return seconds
