"""One scheduled step as one flat int32 message, from the driver to every other rank.

The scheduler runs once, on the driver. Everything a rank needs to run the same step over its
shard - the step's index arrays, its block copies and, on prefill steps that ask for them, the
prompt-logprob plan (whose recomputed positions run the model too) - is written into one int32
array: each field as its length followed by its values. A message is two broadcasts on the control
group: a fixed header (command, length), then the payload.

The decoded step is a worst_case_step.StepArrays, which the ranks' ModelRunner executes exactly as
the driver's executes the scheduler's StepOutput: the same model calls, so the same collectives in
the same order.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from pagedserve.distributed.context import DRIVER_RANK, ParallelContext
from pagedserve.sample.prompt_logprobs import PromptLogprobsPlan, Recompute
from pagedserve.worker.worst_case_step import StepArrays

STEP, STOP = 1, 2
_ARRAYS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "prompt_lens", "logits_indices")
_NO_PLAN = -1


class _Writer:
    def __init__(self):
        self.parts: list[np.ndarray] = []

    def ints(self, *values: int) -> None:
        self.array(np.asarray(values, dtype=np.int32))

    def array(self, values) -> None:
        values = np.ascontiguousarray(values, dtype=np.int32).reshape(-1)
        self.parts += [np.asarray([values.size], dtype=np.int32), values]

    def finish(self) -> np.ndarray:
        return np.concatenate(self.parts)


class _Reader:
    def __init__(self, message: np.ndarray):
        self.message, self.at = message, 0

    def array(self) -> np.ndarray:
        size = int(self.message[self.at])
        values = self.message[self.at + 1:self.at + 1 + size]
        self.at += 1 + size
        return values

    def ints(self) -> list[int]:
        return self.array().tolist()


def encode_step(step, plan: Optional[PromptLogprobsPlan]) -> np.ndarray:
    """The step (a _core.StepOutput or StepArrays) and its prompt-logprob plan as one int32 array."""
    w = _Writer()
    width = step.block_tables.shape[1] if step.block_tables.ndim == 2 else 0
    w.ints(step.max_query_len, step.max_seq_len, step.num_decodes, width)
    for name in _ARRAYS:
        w.array(getattr(step, name))
    w.array(step.block_tables)
    w.array(step.block_copies)
    if plan is None:
        w.ints(_NO_PLAN)
        return w.finish()
    w.ints(plan.top_n)
    w.array(plan.targets)
    w.array(plan.step_rows)
    w.ints(len(plan.recompute))
    for r in plan.recompute:
        w.ints(r.begin, r.prompt_len)
        w.array(r.token_ids)
        w.array(r.block_table)
    return w.finish()


def decode_step(message: np.ndarray) -> tuple[StepArrays, Optional[PromptLogprobsPlan]]:
    r = _Reader(message)
    max_query_len, max_seq_len, num_decodes, width = r.ints()
    arrays = {name: r.array() for name in _ARRAYS}
    num_seqs = len(arrays["seq_lens"])
    step = StepArrays(**arrays, block_tables=r.array().reshape(num_seqs, width),
                      block_copies=r.array().reshape(-1, 2), max_query_len=max_query_len, max_seq_len=max_seq_len,
                      num_decodes=num_decodes)
    (top_n,) = r.ints()
    if top_n == _NO_PLAN:
        return step, None
    plan = PromptLogprobsPlan(top_n, targets=r.ints(), step_rows=r.ints())
    (count,) = r.ints()
    for _ in range(count):
        begin, prompt_len = r.ints()
        plan.recompute.append(Recompute(r.ints(), begin, r.array().copy(), prompt_len))
    return step, plan


class StepChannel:
    """The driver's step messages to the other ranks, over the control group."""

    def __init__(self, parallel: ParallelContext):
        self.parallel = parallel
        self._header = torch.zeros(2, dtype=torch.int32)

    def send_step(self, step, plan: Optional[PromptLogprobsPlan]) -> None:
        self._send(STEP, encode_step(step, plan))

    def send_stop(self) -> None:
        self._send(STOP, np.zeros(0, dtype=np.int32))

    def _send(self, command: int, payload: np.ndarray) -> None:
        self._header[0], self._header[1] = command, payload.size
        group = self.parallel.control
        dist.broadcast(self._header, src=DRIVER_RANK, group=group)
        if payload.size:
            dist.broadcast(torch.from_numpy(payload), src=DRIVER_RANK, group=group)

    def receive(self) -> tuple[int, np.ndarray]:
        """(command, payload) of the driver's next message; blocks until it comes."""
        group = self.parallel.control
        dist.broadcast(self._header, src=DRIVER_RANK, group=group)
        command, size = int(self._header[0]), int(self._header[1])
        payload = torch.empty(size, dtype=torch.int32)
        if size:
            dist.broadcast(payload, src=DRIVER_RANK, group=group)
        return command, payload.numpy()
