"""What a step's sampling hands back: the sampled ids (and logprobs) on their way to the host."""

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
        self.prompt_logprobs: Optional["PendingSamples"] = None  # the step's prompt logprobs (model runner)
        # The sampled ids where the device left them, one per sample (int32): the next step's inputs when the
        # engine runs ahead (StepInputs.prepare). None where a draw may still change on the host.
        self.device_ids = device_ids

    @classmethod
    def ready(cls, output: SamplerOutput) -> "PendingSamples":
        return cls(None, None, lambda host: output, output)

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
        if self._event is not None:
            self._event.synchronize()
        return self._host.numpy()

    def result(self) -> SamplerOutput:
        if self._output is None:
            self._output = self._finish(self.host_ids())
        return self._output
