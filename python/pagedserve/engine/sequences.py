"""Sequences: which sample each scheduler sequence is, and why it finished.

Why did a request finish? Each of its n samples ends for exactly one reason,
decided in one of two places, and both reach the sample through this module:

| what happened                               | finish_reason     | stop_reason   | decided by                      |
|---------------------------------------------|-------------------|---------------|---------------------------------|
| an EOS token (unless ignore_eos)            | "stop"            | None          | scheduler.update() (C++)        |
| a token in stop_token_ids                   | "stop"            | the token id  | scheduler.update() (C++)        |
| max_tokens or max_model_len reached         | "length"          | None          | scheduler.update() (C++)        |
| it can never fit (pool or context too small) | "length" + error  | None          | scheduler.schedule() (C++)      |
| a stop string appeared in the text          | "stop"            | the string    | Sample.sync_text() (Python)     |
| the caller aborted it                       | "abort"           | None          | LLMEngine.abort_request         |

The C++ rules (cpp/scheduler.cc Scheduler::append_token) run on token ids as
each step's tokens are appended; min_tokens holds back EOS and stop tokens.
Stop strings need text, which trails the tokens by one step (the engine
detokenizes while the device runs the next step), so a stop string ends its
sequence one step later: `stop()` tells the scheduler then, and the token
sampled meanwhile is dropped. A scheduler finish is recorded by `ended()` as
the sample's pending `ending` and applied when its last text is flushed.
"""

from __future__ import annotations

from typing import Optional

from pagedserve import _core
from pagedserve.engine.request import Request, Sample

FINISH_REASONS = {
    _core.FinishReason.STOP: "stop",
    _core.FinishReason.LENGTH: "length",
    _core.FinishReason.ABORT: "abort",
    _core.FinishReason.REJECTED: "length",
}
REJECTED_ERROR = "the request does not fit in the KV cache"


class Sequences:
    """Live scheduler sequence id -> (request, sample index)."""

    def __init__(self, scheduler):
        self._scheduler = scheduler
        self._owner: dict[int, tuple[Request, int]] = {}

    def own(self, seq_id: int, request: Request, index: int) -> None:
        self._owner[seq_id] = (request, index)
        request.samples[index].seq_id = seq_id

    def get(self, seq_id: int) -> Optional[tuple[Request, int]]:
        return self._owner.get(int(seq_id))

    def __getitem__(self, seq_id: int) -> tuple[Request, int]:
        return self._owner[int(seq_id)]

    def ended(self, seq_id: int, reason, stop_token: Optional[int] = None,
              error: Optional[str] = None) -> Optional[Request]:
        """The scheduler finished a sequence (its blocks are already back in the pool); `error` when it
        was rejected. Its sample ends at the next text sync; returns the request to sync, None for a
        sequence no longer owned."""
        owner = self._owner.pop(seq_id, None)
        if owner is None:
            return None
        request, index = owner
        sample = request.samples[index]
        sample.seq_id = None
        stop_ids = request.params.stop_token_ids or []
        sample.ending = (FINISH_REASONS[reason], stop_token if stop_token in stop_ids else None)
        if error is not None:
            request.error = error
        return request

    def stop(self, sample: Sample, reason=_core.FinishReason.STOP) -> None:
        """Python ended the sample (a stop string, or an abort): finish its sequence in the scheduler
        now, so its blocks return at once."""
        if sample.seq_id is not None and self._owner.pop(sample.seq_id, None) is not None:
            self._scheduler.finish(sample.seq_id, reason)
        sample.seq_id = None
