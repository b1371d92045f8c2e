"""KV memory schemes for bench/memory_bench.py, simulated step by step.

Two per-request contiguous baselines run in plain Python; the paged scheme runs
the real scheduler and block pool (pagedserve._core) with made-up sampled
tokens. All three follow the same rules, so their figures compare:

- a step writes the KV of every running sequence's pending tokens (a whole
  prompt on admission, one token per decode) and samples one token each;
- a sequence that has sampled its output length finishes and frees its memory;
- waiting requests are admitted first come, first served while rows, the
  step's token budget and memory (less a small watermark) allow;
- a running sequence that cannot grow preempts the most recently admitted
  other sequence, which drops its KV and is recomputed when readmitted.

Memory is counted in token slots; reserved = slots held, used = slots that
hold a token's KV.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Request:
    prompt_len: int
    output_len: int


@dataclass
class SchedulingLimits:
    memory_tokens: int          # KV slots in the pool
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int = 16        # the paged scheme's block; also its watermark granularity
    watermark: float = 0.01     # fraction of memory admission leaves free while anything runs


@dataclass
class Trace:
    """Per-step figures of one scheme over the whole workload."""
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    used: list[int] = field(default_factory=list)
    peak_with_copies: int = 0   # reserved plus the old buffers alive while grow-by-copy copies
    preemptions: int = 0
    recomputed_tokens: int = 0
    max_waste_per_seq: int = 0  # worst reserved - used of one sequence in any step

    @property
    def steps(self) -> int:
        return len(self.running)

    def running_while_queued(self) -> float:
        """Mean sequences running in steps that left requests waiting: what the memory holds when full."""
        busy = [r for r, w in zip(self.running, self.waiting) if w > 0]
        return sum(busy) / len(busy) if busy else float(max(self.running))


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass
class _Seq:
    request: Request
    generated: int = 0
    capacity: int = 0
    admit_order: int = 0

    @property
    def kv_tokens(self) -> int:
        """Tokens whose KV this step holds once it has run: prompt plus every token sampled before it."""
        return self.request.prompt_len + self.generated


class ContiguousScheme:
    """Reserves max_model_len slots per request on admission (a static KV cache)."""
    name = "contiguous (max_model_len each)"

    def __init__(self, limits: SchedulingLimits):
        self.limits = limits

    def initial_capacity(self, tokens: int) -> int:
        return self.limits.max_model_len

    def grown_capacity(self, capacity: int, tokens: int) -> int:
        raise AssertionError("a max_model_len reservation never needs to grow")


class GrowByCopyScheme:
    """A per-request buffer that doubles when full: the new one is allocated and
    the KV copied before the old one is freed, so both exist for a moment."""
    name = "grow-by-copy (capacity doubling)"

    def __init__(self, limits: SchedulingLimits):
        self.limits = limits

    def initial_capacity(self, tokens: int) -> int:
        return min(next_pow2(tokens), self.limits.max_model_len)

    def grown_capacity(self, capacity: int, tokens: int) -> int:
        return min(max(2 * capacity, next_pow2(tokens)), self.limits.max_model_len)


def simulate_contiguous(scheme, requests: list[Request], on_finish: Callable[[int], None]) -> Trace:
    """Runs the workload under a per-request contiguous scheme; on_finish(k) reports k finished requests."""
    limits = scheme.limits
    waiting: list[_Seq] = [_Seq(r) for r in requests]
    waiting.reverse()  # pop() takes the queue head
    running: list[_Seq] = []
    trace = Trace()
    reserved = 0
    admitted = 0
    watermark = int(limits.watermark * limits.memory_tokens)

    def preempt(victim: _Seq) -> None:
        nonlocal reserved
        running.remove(victim)
        reserved -= victim.capacity
        trace.preemptions += 1
        trace.recomputed_tokens += victim.kv_tokens
        victim.capacity = 0
        waiting.append(victim)

    while waiting or running:
        peak = reserved
        for seq in sorted(running, key=lambda s: s.admit_order):
            if seq not in running or seq.kv_tokens <= seq.capacity:
                continue
            new = scheme.grown_capacity(seq.capacity, seq.kv_tokens)
            while reserved + new > limits.memory_tokens:
                others = [s for s in running if s is not seq]
                if not others:
                    raise RuntimeError("one sequence outgrew the whole memory; raise the memory size")
                preempt(max(others, key=lambda s: s.admit_order))
            peak = max(peak, reserved + new)  # old and new buffers both held during the copy
            reserved += new - seq.capacity
            seq.capacity = new
        budget = limits.max_num_batched_tokens - len(running)
        first_prefill = True
        while waiting and len(running) < limits.max_num_seqs:
            seq = waiting[-1]
            tokens = seq.kv_tokens
            capacity = scheme.initial_capacity(tokens)
            margin = watermark if running else 0
            if tokens > budget and not first_prefill:
                break
            if reserved + capacity + margin > limits.memory_tokens:
                break
            waiting.pop()
            seq.capacity, seq.admit_order = capacity, admitted
            admitted += 1
            reserved += capacity
            running.append(seq)
            budget -= tokens
            first_prefill = False
        if not running:
            raise RuntimeError("a request cannot be admitted into an empty memory; raise the memory size")
        used = sum(s.kv_tokens for s in running)
        trace.running.append(len(running))
        trace.waiting.append(len(waiting))
        trace.reserved.append(reserved)
        trace.used.append(used)
        trace.peak_with_copies = max(trace.peak_with_copies, peak, reserved)
        trace.max_waste_per_seq = max(trace.max_waste_per_seq, max(s.capacity - s.kv_tokens for s in running))
        finished = 0
        for seq in list(running):
            seq.generated += 1
            if seq.generated == seq.request.output_len:
                running.remove(seq)
                reserved -= seq.capacity
                finished += 1
        on_finish(finished)
    return trace


def simulate_paged(limits: SchedulingLimits, requests: list[Request], on_finish: Callable[[int], None],
                   check_every: int = 16, seed: int = 0) -> Trace:
    """Runs the workload through the real scheduler and block pool (prefix caching off:
    the prompts are random, and shared blocks would muddle the per-sequence accounting)."""
    from pagedserve import _core

    bs = limits.block_size
    scheduler = _core.Scheduler(_core.SchedulerConfig(
        num_blocks=limits.memory_tokens // bs, block_size=bs, max_num_seqs=limits.max_num_seqs,
        max_num_batched_tokens=limits.max_num_batched_tokens, max_model_len=limits.max_model_len,
        enable_prefix_caching=False, watermark=limits.watermark))
    rng = np.random.default_rng(seed)
    for r in requests:
        prompt = rng.integers(0, 30000, size=r.prompt_len, dtype=np.int32)
        scheduler.add_sequence(prompt, max_tokens=r.output_len, ignore_eos=True)
    trace = Trace()
    while scheduler.has_unfinished():
        step = scheduler.schedule()
        stats = scheduler.stats()
        reserved = stats["num_used_blocks"] * bs
        waste = stats["internal_fragmentation_slots"]
        # Each running sequence wastes less than one block: only its last block is partly filled.
        assert waste <= (bs - 1) * stats["num_running"], (waste, stats["num_running"])
        if trace.steps % check_every == 0:
            trace.max_waste_per_seq = max(trace.max_waste_per_seq, _worst_sequence_waste(scheduler, bs))
        trace.running.append(stats["num_running"])
        trace.waiting.append(stats["num_waiting"])
        trace.reserved.append(reserved)
        trace.used.append(reserved - waste)
        trace.peak_with_copies = max(trace.peak_with_copies, reserved)
        sampled = rng.integers(0, 30000, size=step.total_samples, dtype=np.int32)
        on_finish(len(scheduler.update(sampled).finished) + len(step.rejected))
        if step.rejected:
            raise RuntimeError(f"{len(step.rejected)} request(s) can never fit; raise the memory size")
    stats = scheduler.stats()
    trace.preemptions, trace.recomputed_tokens = stats["num_preemptions"], stats["num_preempted_tokens"]
    return trace


def _worst_sequence_waste(scheduler, block_size: int) -> int:
    """Recomputes the waste bound from each sequence's own block table (an independent check)."""
    worst = 0
    for seq_id in scheduler.running_ids:
        seq: dict | None = scheduler.sequence(seq_id)
        if seq is None:
            continue
        waste = len(seq["block_ids"]) * block_size - len(seq["token_ids"])
        assert waste < block_size, f"sequence {seq_id} holds {waste} empty slots, a whole block or more"
        worst = max(worst, waste)
    return worst
