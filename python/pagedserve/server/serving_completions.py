"""POST /v1/completions: the legacy text completion API, streaming or not.

A body may hold several prompts; each becomes an engine request, and choice
i * n + j is sample j of prompt i, as the OpenAI API numbers them.

echo puts the prompt's text (and with logprobs its tokens' logprobs, the engine's
prompt logprobs) before each choice's first generated delta, as vLLM does;
max_tokens=0 with echo scores the prompt: the engine generates one token, which
is dropped.
"""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedserve.server.async_engine import EngineStepError, OutputStream
from pagedserve.server.context import ServerContext
from pagedserve.server.engine_inputs import (check_completion_options, check_prompts, completion_prompts,
                                             sampling_params, structured_outputs)
from pagedserve.server.errors import error_body
from pagedserve.server.logprobs import (CompletionLogprobs, merge_completion_logprobs, prompt_completion_logprobs,
                                        vllm_prompt_logprobs)
from pagedserve.server.protocol import CompletionRequest
from pagedserve.server.serving_common import (Usage, aborted_by_shutdown, client_gone, engine_failure_response,
                                              finish_fields, sse_events)
from pagedserve.server.streaming import sse_response, until_disconnected


async def create_completion(ctx: ServerContext, body: CompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    ctx.require_ready()
    ctx.check_model(body.model)
    check_completion_options(body)
    prompts = completion_prompts(body, ctx.tokenizer)
    max_tokens = 1 if body.max_tokens == 0 else body.max_tokens  # 0 (with echo): one token, dropped
    params = sampling_params(body, max_tokens, body.logprobs, ctx.default_sampling, structured_outputs(body))
    wanted = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
    params.prompt_logprobs = max(wanted) if wanted else None
    check_prompts(prompts, params, ctx.limits)
    call = _Completion(ctx, body, prompts, f"cmpl-{uuid.uuid4().hex}")
    if body.stream:
        stream = await ctx.generate(prompts, params, call.id, arrival)
        return sse_response(sse_events(call.id, stream, call.chunks(stream)))
    result = await until_disconnected(request, call.collect(params, arrival))
    return client_gone() if result is None else result


class _Completion:
    def __init__(self, ctx: ServerContext, body: CompletionRequest, prompts: list[dict], call_id: str):
        self.ctx = ctx
        self.body = body
        self.prompts = prompts
        self.id = call_id
        self.created = int(time.time())
        self.usage = Usage(prompt_tokens=sum(len(p["prompt_token_ids"]) for p in prompts))
        num_choices = len(prompts) * body.n
        echo = [self._prompt_text(i // body.n) if body.echo else "" for i in range(num_choices)]
        self.echo = echo
        self.logprobs = [CompletionLogprobs(body.logprobs, len(echo[i])) if body.logprobs is not None else None
                         for i in range(num_choices)]
        self.scoring = body.max_tokens == 0  # echo only: the one generated token is dropped
        self.started = [False] * num_choices  # the choice's first delta went out (with the echo)
        self.prompt_logprobs: dict[int, list] = {}  # per prompt: RequestOutput.prompt_logprobs (first delta)

    def _prompt_text(self, prompt_index: int) -> str:
        p = self.prompts[prompt_index]
        return p["prompt"] if p["prompt"] is not None else self.ctx.tokenizer.decode(p["prompt_token_ids"])

    def _envelope(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.ctx.served_model_name, "choices": choices}

    def _count(self, prompt_index: int, out) -> None:
        self.usage.add(prompt_index, out)
        if self.scoring:
            self.usage.completion_tokens = 0
        if getattr(out, "prompt_logprobs", None) is not None:
            self.prompt_logprobs[prompt_index] = out.prompt_logprobs

    def _choice_delta(self, prompt_index: int, c) -> tuple[int, str, Optional[dict], dict]:
        """(choice index, text, logprobs, other fields) of one CompletionOutput delta; a choice's first
        delta starts with the echo."""
        index = prompt_index * self.body.n + c.index
        text, token_ids, entries, fields = c.text, c.token_ids, c.logprobs, finish_fields(c)
        if self.scoring:
            text, token_ids, entries = "", [], [] if entries is not None else None
            fields = {"finish_reason": "length", "stop_reason": None} if c.finish_reason else fields
        builder = self.logprobs[index]
        logprobs = builder.delta(token_ids, entries) if builder is not None else None
        if not self.started[index]:
            self.started[index] = True
            text = self.echo[index] + text
            prompt_entries = self.prompt_logprobs.get(prompt_index)
            if self.body.echo and builder is not None and prompt_entries is not None:
                ids = self.prompts[prompt_index]["prompt_token_ids"]
                first = self.ctx.tokenizer.decode(ids[:1]) if self.ctx.tokenizer is not None else ""
                prompt_part = prompt_completion_logprobs(ids, prompt_entries, first, builder.top_n)
                logprobs = merge_completion_logprobs([prompt_part] + ([logprobs] if logprobs else []))
            if self.body.prompt_logprobs is not None:
                fields = {**fields, "prompt_logprobs": vllm_prompt_logprobs(prompt_entries)}
        return index, text, logprobs, fields

    # ------------------------------------------------------------------ streaming
    async def chunks(self, stream: OutputStream) -> AsyncIterator[dict]:
        async for prompt_index, out in stream:
            self._count(prompt_index, out)
            choices = []
            for c in out.outputs:
                index, text, logprobs, fields = self._choice_delta(prompt_index, c)
                if text or c.finish_reason or (logprobs and logprobs["tokens"]) or "prompt_logprobs" in fields:
                    choices.append({"index": index, "text": text, "logprobs": logprobs, **fields})
            if choices:
                yield self._envelope(choices)
        if self.body.include_usage:
            yield {**self._envelope([]), "usage": self.usage.as_dict()}

    # ------------------------------------------------------------------ one response
    async def collect(self, params, arrival: float) -> Response:
        stream = await self.ctx.generate(self.prompts, params, self.id, arrival)
        num_choices = len(self.prompts) * self.body.n
        texts = [""] * num_choices
        logprob_parts: list[list[dict]] = [[] for _ in range(num_choices)]
        finals: list[dict] = [{} for _ in range(num_choices)]
        extras: list[dict] = [{} for _ in range(num_choices)]
        try:
            async for prompt_index, out in stream:
                self._count(prompt_index, out)
                for c in out.outputs:
                    index, text, logprobs, fields = self._choice_delta(prompt_index, c)
                    texts[index] += text
                    if logprobs:
                        logprob_parts[index].append(logprobs)
                    if "prompt_logprobs" in fields:
                        extras[index]["prompt_logprobs"] = fields.pop("prompt_logprobs")
                    if c.finish_reason:
                        finals[index] = fields
        except EngineStepError as err:
            return engine_failure_response(self.id, err)
        finally:
            stream.close()
        if aborted_by_shutdown(self.ctx, finals):
            return JSONResponse(error_body(503, "the server shut down before the request finished"), 503)
        choices = [{"index": i, "text": texts[i],
                    "logprobs": merge_completion_logprobs(logprob_parts[i]) if self.logprobs[i] else None,
                    **finals[i], **extras[i]} for i in range(num_choices)]
        return JSONResponse({**self._envelope(choices), "usage": self.usage.as_dict()})
