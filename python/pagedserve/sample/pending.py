"""What a step's sampling hands back: the sampled ids (and logprobs) on their way to the host.

A PendingSamples is queued on the device when made, or, deferred, once its input is ready: the sampler
defers a plain draw whose grammar masks are filling on the grammar thread (engine/grammar_thread.py),
and the engine queues it (launch) just before the next forward, which reads its ids on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch


@dataclass
class SampleLogprobs:
    """Log-probabilities of one sampled token under the raw model distribution."""

    token_id: int
    logprob: float
    rank: int  # 1 + the number of tokens strictly more likely than the sampled one
    top: list[tuple[int, float]]  # the row's top-N (token id, logprob), most likely first


@dataclass
class SamplerOutput:
    token_ids: list[int]  # sum(num_samples) ids, row-major: row 0's samples first
    logprobs: Optional[list[Optional[SampleLogprobs]]]  # per sample; None: nobody asked


class PendingSamples:
    """Sampled ids on their way to the host: one non-blocking copy into pinned
    memory, so the caller can do host work while the device finishes the step."""

    def __init__(self, host: Optional[torch.Tensor], event, finish: Callable[[np.ndarray], SamplerOutput],
                 output: Optional[SamplerOutput] = None, device_ids: Optional[torch.Tensor] = None):
        self._host, self._event, self._finish, self._output = host, event, finish, output
        self._queue: Optional[Callable[[], "PendingSamples"]] = None  # a deferred draw, until launch()
        self.prompt_logprobs: Optional["PendingSamples"] = None  # the step's prompt logprobs (model runner)
        # The sampled ids where the device left them, one per sample (int32): the next step's inputs when the
        # engine runs ahead (StepInputs.prepare). None where a draw may still change on the host.
        self.device_ids = device_ids

    @classmethod
    def ready(cls, output: SamplerOutput) -> "PendingSamples":
        return cls(None, None, lambda host: output, output)

    @classmethod
    def deferred(cls, queue: Callable[[], "PendingSamples"], device_ids: torch.Tensor) -> "PendingSamples":
        """A draw queued later, by launch() or result(): `queue()` queues it and returns its PendingSamples.
        `device_ids`, which that draw writes, exist now, so the next step's forward may be prepared from
        them (it must be queued after launch())."""
        pending = cls(None, None, lambda host: SamplerOutput([], None), device_ids=device_ids)
        pending._queue = queue
        return pending

    @property
    def waiting_to_launch(self) -> bool:
        """A deferred draw not queued yet."""
        return self._queue is not None

    def launch(self) -> None:
        """Queues a deferred draw (once); nothing for the others."""
        if self._queue is not None:
            queued, self._queue = self._queue(), None
            self._host, self._event, self._finish, self._output = (queued._host, queued._event, queued._finish,
                                                                   queued._output)

    @classmethod
    def copy(cls, device_ints: torch.Tensor, finish: Callable[[np.ndarray], SamplerOutput],
             device_ids: Optional[torch.Tensor] = None) -> "PendingSamples":
        """The single device-to-host copy of a step's results (`device_ids`: see __init__)."""
        if device_ints.device.type != "cuda":
            return cls(device_ints, None, finish, device_ids=device_ids)
        host = torch.empty(device_ints.shape, dtype=device_ints.dtype, pin_memory=True)
        host.copy_(device_ints, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(host, event, finish, device_ids=device_ids)

    def host_ids(self) -> np.ndarray:
        """What the device left, as it reaches the host, without result()'s conversion: what a thread other
        than the engine's may wait for (the wait drops the GIL); a plain draw's ids alone."""
        if self._queue is not None:
            raise RuntimeError("the draw is not queued yet")
        if self._event is not None:
            self._event.synchronize()
        return self._host.numpy()

    def result(self) -> SamplerOutput:
        self.launch()
        if self._output is None:
            self._output = self._finish(self.host_ids())
        return self._output
