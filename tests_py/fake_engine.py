"""A scripted stand-in for LLMEngine, for testing the server's engine loop
without a model: the same methods and output types, a byte-level
"tokenizer", and a KV pool of one block per `block_size` tokens so aborts
and leaks are visible.

Sample j of a request emits tokens (len(prompt) + j + k) % 26 + ord('a') for
k = 0, 1, ..., so tests know every output in advance.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

from pagedserve.outputs import CompletionOutput, RequestMetrics, RequestOutput


def expected_text(prompt_len: int, sample_index: int, num_tokens: int) -> str:
    return "".join(chr((prompt_len + sample_index + k) % 26 + ord("a")) for k in range(num_tokens))


class ByteTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, **_) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


@dataclass
class _Sample:
    index: int
    token_ids: list[int] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    changed: bool = False


class FakeRequest:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params, arrival_time: float):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.samples = [_Sample(i) for i in range(params.n)]

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def take_delta(self) -> Optional[RequestOutput]:
        changed = [s for s in self.samples if s.changed]
        if not changed:
            return None
        outputs = [CompletionOutput(index=s.index, text=bytes(s.new_tokens).decode(), token_ids=s.new_tokens,
                                    finish_reason=s.finish_reason) for s in changed]
        for s in changed:
            s.new_tokens, s.changed = [], False
        return RequestOutput(self.request_id, None, self.prompt_token_ids, outputs, self.finished, self.metrics)


class _FakeScheduler:
    """Sequence id i is the engine's i-th unfinished request."""

    def __init__(self, engine: "FakeEngine"):
        self._engine = engine
        self.pool = SimpleNamespace(block_states=engine._block_states)
        self.config = SimpleNamespace(block_size=engine.block_size, max_num_seqs=engine.max_num_seqs)

    @property
    def running_ids(self) -> list[int]:
        return list(range(len(self._engine.running_requests())))

    @property
    def waiting_ids(self) -> list[int]:
        return list(range(len(self._engine.running_requests()), len(self._engine.requests)))


class FakeEngine:
    def __init__(self, num_blocks: int = 64, block_size: int = 4, max_model_len: int = 64, max_num_seqs: int = 4,
                 step_seconds: float = 0.0):
        self.tokenizer = ByteTokenizer()
        self.max_model_len = max_model_len
        self.step_seconds = step_seconds
        self.fail_next_step = False
        self.requests: dict[str, FakeRequest] = {}
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.config = SimpleNamespace(max_logprobs=5)
        self.model_config = SimpleNamespace(vocab_size=256)
        self.scheduler = _FakeScheduler(self)
        self.thread_ids: set[int] = set()  # every thread that called into the engine
        self.num_steps = 0
        self._last_step = (0, 0, 0)

    # -- the LLMEngine interface the server uses --------------------------------------------------------
    def add_request(self, request_id, prompt, params, arrival_time=None) -> None:
        self.thread_ids.add(threading.get_ident())
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = list(prompt["prompt_token_ids"])
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt plus max_tokens is more than max_model_len ({self.max_model_len})")
        self.requests[request_id] = FakeRequest(request_id, ids, params, arrival_time or time.monotonic())

    def abort_request(self, request_id) -> None:
        self.thread_ids.add(threading.get_ident())
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for s in request.samples:
            if s.finish_reason is None:
                s.finish_reason, s.changed = "abort", True
        request.metrics.finished_time = time.monotonic()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected step failure")
        if self.step_seconds:
            time.sleep(self.step_seconds)
        self.num_steps += 1
        running = self.running_requests()
        now = time.monotonic()
        outputs = []
        for request in running:
            first_step = request.metrics.first_token_time is None
            for s in request.samples:
                if s.finish_reason is not None:
                    continue
                token = (len(request.prompt_token_ids) + s.index + len(s.token_ids)) % 26 + ord("a")
                s.token_ids.append(token)
                s.new_tokens.append(token)
                s.changed = True
                if len(s.token_ids) >= request.params.max_tokens:
                    s.finish_reason = "length"
            request.metrics.first_token_time = request.metrics.first_token_time or now
            request.metrics.last_token_time = now
            self._last_step = (len(request.prompt_token_ids) if first_step else 0, 0 if first_step else 1,
                               len(running))
            outputs.append(request.take_delta())
            if request.finished:
                request.metrics.finished_time = now
                del self.requests[request.request_id]
        return outputs

    def stats(self) -> dict:
        used = sum(self._blocks_of(r) for r in self.running_requests())
        running = len(self.running_requests())
        prefill, decode, seqs = self._last_step
        return {"num_running": running, "num_waiting": len(self.requests) - running, "num_blocks": self.num_blocks,
                "num_free_blocks": self.num_blocks - used, "num_evictable_blocks": 0, "num_used_blocks": used,
                "pool_utilization": used / self.num_blocks, "prefix_hit_rate": 0.0, "num_preemptions": 0,
                "step_num_seqs": seqs, "step_prefill_tokens": prefill, "step_decode_tokens": decode}

    def request_id_of(self, seq_id: int) -> Optional[str]:
        ids = list(self.requests)
        return ids[seq_id] if 0 <= seq_id < len(ids) else None

    # -- helpers ---------------------------------------------------------------------------------------
    def running_requests(self) -> list[FakeRequest]:
        return list(self.requests.values())[:self.max_num_seqs]

    def _blocks_of(self, request: FakeRequest) -> int:
        tokens = len(request.prompt_token_ids) + max(len(s.token_ids) for s in request.samples)
        return -(-tokens // self.block_size)

    def _block_states(self) -> bytes:
        used = min(sum(self._blocks_of(r) for r in self.running_requests()), self.num_blocks)
        return bytes([1] * used + [0] * (self.num_blocks - used))
