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
                 output: Optional[SamplerOutput] = None, device_ids: Optional[torch.Tensor] = None, device: int = 0):
        self._host, self._event, self._finish, self._output = host, event, finish, output
        self._device = device  # the event's CUDA device
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
        return cls(host, event, finish, device_ids=device_ids, device=device_ints.get_device())

    def host_view(self) -> tuple[int, int, int, int]:
        """Where a plain draw's ids reach the host, for a thread outside Python (cpp/grammar/grammar_worker.h):
        the int32 buffer's address and length, the CUDA event after which they are in (0: they are) and its
        device."""
        if self._host.dtype != torch.int32 or not self._host.is_contiguous():
            raise ValueError(f"a draw's ids are contiguous int32, not {self._host.dtype}")
        if self._event is None:
            return self._host.data_ptr(), self._host.numel(), 0, 0
        return self._host.data_ptr(), self._host.numel(), self._event.cuda_event, self._device

    def result(self) -> SamplerOutput:
        if self._output is None:
            if self._event is not None:
                self._event.synchronize()
            self._output = self._finish(self._host.numpy())
        return self._output
