"""A scripted stand-in for LLMEngine, for testing the server without a model.

FakeEngine implements the server's EngineClient protocol
(pagedserve/server/engine_client.py) and nothing more: info, add / abort
returning the final outputs, step, stats, snapshot, check_health and shutdown
(a step with --fake-dead-prompt's text raises EngineDeadError). It has a byte-level
"tokenizer" with a trivial chat template, a KV pool of one block per
`block_size` tokens so aborts and leaks are visible, and a prefix cache that
reports the whole blocks a prompt shares with an earlier one.

Sample j of a request emits tokens (len(prompt) + j + k) % 26 + ord('a') for
k = 0, 1, ..., so tests know every output in advance.

Run as a script it is a whole server over the fake (fast to start, no model):

    python tests_py/fake_engine.py --port 8123 [server flags] [--fake-step-seconds 0.01]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from pagedserve.engine.info import EngineInfo
from pagedserve.engine.validation import EngineLimits, validate_request
from pagedserve.errors import EngineDeadError, RequestError
from pagedserve.outputs import CompletionOutput, RequestMetrics, RequestOutput

BLOCK_STATE_NAMES = {"0": "free", "1": "in_use", "2": "shared", "3": "cached"}
CRASH = "<crash>"
# Text of the fake's exceptions that must reach the log, never a response.
SECRET = "secret detail /srv/models/weights.bin"


def expected_text(prompt_len: int, sample_index: int, num_tokens: int) -> str:
    return "".join(chr((prompt_len + sample_index + k) % 26 + ord("a")) for k in range(num_tokens))


class ByteTokenizer:
    """Bytes as token ids; a chat renders as 'role: content' lines and a final 'assistant: '.
    Text holding CRASH makes encode() raise, as a tokenizer bug would."""

    bos_token_id = None
    bos_token = None
    name_or_path = "fake-bytes"
    chat_template = "role: content lines"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if CRASH in text:
            raise RuntimeError(f"tokenizer exploded: {SECRET}")
        return list(text.encode("utf-8"))

    def decode(self, ids, **_) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [bytes([i]).decode("latin-1") for i in ids]

    def apply_chat_template(self, messages, tokenize: bool = False, add_generation_prompt: bool = True) -> str:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")


@dataclass
class _Sample:
    index: int
    token_ids: list[int] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    changed: bool = False


class _Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params, max_tokens: int, arrival_time: float,
                 num_cached_tokens: int):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.max_tokens = max_tokens
        self.num_cached_tokens = num_cached_tokens
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
        return RequestOutput(self.request_id, None, self.prompt_token_ids, outputs, self.finished, self.metrics,
                             num_cached_tokens=self.num_cached_tokens)


class FakeEngine:
    def __init__(self, num_blocks: int = 64, block_size: int = 4, max_model_len: int = 64, max_num_seqs: int = 4,
                 step_seconds: float = 0.0, max_logprobs: int = 5, vocab_size: int = 256,
                 default_sampling: Optional[dict] = None, fail_prompt: Optional[str] = None,
                 dead_prompt: Optional[str] = None):
        self.step_seconds = step_seconds
        self.fail_next_step = False
        # A step with a request of this prompt raises (as a device error would):
        self.fail_prompt = list(fail_prompt.encode()) if fail_prompt else None
        # A step with a request holding this text raises EngineDeadError (as a dead rank would), and so
        # does every call after it:
        self.dead_prompt = list(dead_prompt.encode()) if dead_prompt else None
        self.dead: Optional[EngineDeadError] = None
        self.shut_down = False
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.limits = EngineLimits(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                   max_logprobs=max_logprobs, vocab_size=vocab_size)
        self.default_sampling = dict(default_sampling or {})
        self._tokenizer = ByteTokenizer()
        self._requests: dict[str, _Request] = {}
        self._cached_prefixes: set[tuple[int, ...]] = set()  # whole-block prompt prefixes seen
        # Test instrumentation, not part of the interface:
        self.thread_ids: set[int] = set()  # every thread that called into the engine
        self.added_params: dict[str, object] = {}  # the SamplingParams each request came with
        self.num_steps = 0
        self._last_step = (0, 0, 0)

    # -- the EngineClient interface -------------------------------------------------------------------
    def info(self) -> EngineInfo:
        return EngineInfo(model_name="fake-model", model_path=Path("/models/fake-model"), device="cpu",
                          dtype="float32", tokenizer=self._tokenizer, limits=self.limits,
                          default_sampling=dict(self.default_sampling))

    def add_request(self, request_id, prompt, params, arrival_time=None) -> None:
        self.thread_ids.add(threading.get_ident())
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id", "duplicate_id")
        ids = validate_request(list(prompt["prompt_token_ids"]), params, self.limits)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.limits.max_model_len - len(ids)
        self._requests[request_id] = _Request(request_id, ids, params, max_tokens, arrival_time or time.monotonic(),
                                              self._cache(ids))
        self.added_params[request_id] = params

    def abort_request(self, request_ids) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        finals = []
        for rid in request_ids:
            request = self._requests.pop(rid, None)
            if request is None:
                continue
            for s in request.samples:
                if s.finish_reason is None:
                    s.finish_reason, s.changed = "abort", True
            request.metrics.finished_time = time.monotonic()
            delta = request.take_delta()
            if delta is not None:
                finals.append(delta)
        return finals

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        if self.dead_prompt and any(_contains(r.prompt_token_ids, self.dead_prompt) for r in self._requests.values()):
            self.dead = EngineDeadError("rank 1", "injected: the process died (signal SIGKILL)")
        self.check_health()
        if self.fail_next_step or any(r.prompt_token_ids == self.fail_prompt for r in self._requests.values()):
            self.fail_next_step = False
            raise RuntimeError(f"injected step failure: {SECRET}")
        if self.step_seconds:
            time.sleep(self.step_seconds)
        self.num_steps += 1
        running = self._running()
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
                if len(s.token_ids) >= request.max_tokens:
                    s.finish_reason = "length"
            request.metrics.first_token_time = request.metrics.first_token_time or now
            request.metrics.last_token_time = now
            self._last_step = (len(request.prompt_token_ids) if first_step else 0, 0 if first_step else 1,
                               len(running))
            outputs.append(request.take_delta())
            if request.finished:
                request.metrics.finished_time = now
                del self._requests[request.request_id]
        return outputs

    def stats(self) -> dict:
        used = sum(self._blocks_of(r) for r in self._running())
        running = len(self._running())
        prefill, decode, seqs = self._last_step
        return {"num_running": running, "num_waiting": len(self._requests) - running,
                "num_blocks": self.num_blocks, "num_free_blocks": self.num_blocks - used, "num_evictable_blocks": 0,
                "num_used_blocks": used, "pool_utilization": used / self.num_blocks, "prefix_hit_rate": 0.0,
                "num_preemptions": 0, "step_num_seqs": seqs, "step_prefill_tokens": prefill,
                "step_decode_tokens": decode}

    def snapshot(self) -> dict:
        used = min(sum(self._blocks_of(r) for r in self._running()), self.num_blocks)
        running = self._running()
        return {"stats": self.stats(), "block_size": self.block_size,
                "block_states": "1" * used + "0" * (self.num_blocks - used), "block_state_names": BLOCK_STATE_NAMES,
                "running": [self._summary(r) for r in running],
                "waiting": [self._summary(r) for r in list(self._requests.values())[len(running):]],
                "num_unfinished_requests": len(self._requests)}

    def check_health(self) -> None:
        if self.dead is not None:
            raise self.dead

    def shutdown(self) -> None:
        self.shut_down = True

    # -- helpers ---------------------------------------------------------------------------------------
    def _running(self) -> list[_Request]:
        return list(self._requests.values())[:self.max_num_seqs]

    def _blocks_of(self, request: _Request) -> int:
        tokens = len(request.prompt_token_ids) + max(len(s.token_ids) for s in request.samples)
        return -(-tokens // self.block_size)

    def _cache(self, ids: list[int]) -> int:
        """Prompt tokens in whole blocks an earlier prompt began with (the last token is never cached)."""
        whole = (len(ids) - 1) // self.block_size
        hit = 0
        for k in range(1, whole + 1):
            prefix = tuple(ids[:k * self.block_size])
            if prefix in self._cached_prefixes:
                hit = k * self.block_size
            self._cached_prefixes.add(prefix)
        return hit

    @staticmethod
    def _summary(request: _Request) -> dict:
        return {"id": request.request_id, "prompt_tokens": len(request.prompt_token_ids), "n": len(request.samples),
                "output_tokens": max((len(s.token_ids) for s in request.samples), default=0)}


def _contains(ids: list[int], part: list[int]) -> bool:
    return bytes(part) in bytes(ids) if all(0 <= t < 256 for t in ids) else False


class ProtocolOnly:
    """An engine seen through the EngineClient protocol alone: any other attribute is an AttributeError,
    so a server that reaches past the interface fails its tests."""

    def __init__(self, engine):
        from pagedserve.server.engine_client import EngineClient
        self._engine = engine
        self._names = {n for n in vars(EngineClient) if not n.startswith("_")}

    def __getattr__(self, name: str):
        if name.startswith("_") or name not in self._names:
            raise AttributeError(f"the server used engine.{name}, which is not part of EngineClient")
        return getattr(self._engine, name)


def main(argv: Optional[list[str]] = None) -> int:
    from pagedserve.server.app import serve
    from pagedserve.server.args import add_server_args

    parser = argparse.ArgumentParser(description="pagedserve's server over FakeEngine (tests)")
    parser.add_argument("-v", "--verbose", action="store_true")
    add_server_args(parser)
    g = parser.add_argument_group("fake engine")
    g.add_argument("--fake-step-seconds", type=float, default=0.0)
    g.add_argument("--fake-load-seconds", type=float, default=0.0)
    g.add_argument("--fake-max-model-len", type=int, default=256)
    g.add_argument("--fake-max-num-seqs", type=int, default=4)
    g.add_argument("--fake-temperature", type=float, default=None, help="the model's default temperature")
    g.add_argument("--fake-fail-prompt", default=None, help="a step with a request of this prompt raises")
    g.add_argument("--fake-dead-prompt", default=None,
                   help="a step with a request holding this text raises EngineDeadError, as a dead rank would")
    args = parser.parse_args(argv)

    def build() -> ProtocolOnly:
        time.sleep(args.fake_load_seconds)
        defaults = {"temperature": args.fake_temperature} if args.fake_temperature is not None else {}
        return ProtocolOnly(FakeEngine(num_blocks=256, max_model_len=args.fake_max_model_len,
                                       max_num_seqs=args.fake_max_num_seqs, step_seconds=args.fake_step_seconds,
                                       default_sampling=defaults, fail_prompt=args.fake_fail_prompt,
                                       dead_prompt=args.fake_dead_prompt))
    return serve(args, build_engine=build)


if __name__ == "__main__":
    sys.exit(main())
