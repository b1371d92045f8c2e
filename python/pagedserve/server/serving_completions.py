"""POST /v1/completions: the legacy text completion API, streaming or not.

A body may hold several prompts; each becomes an engine request, and choice
i * n + j is sample j of prompt i, as the OpenAI API numbers them.
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
                                             sampling_params)
from pagedserve.server.errors import error_body
from pagedserve.server.logprobs import CompletionLogprobs, merge_completion_logprobs
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
    params = sampling_params(body, body.max_tokens, body.logprobs, ctx.default_sampling)
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

    def _prompt_text(self, prompt_index: int) -> str:
        p = self.prompts[prompt_index]
        return p["prompt"] if p["prompt"] is not None else self.ctx.tokenizer.decode(p["prompt_token_ids"])

    def _envelope(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.ctx.served_model_name, "choices": choices}

    def _choice_delta(self, prompt_index: int, c) -> tuple[int, Optional[dict]]:
        index = prompt_index * self.body.n + c.index
        builder = self.logprobs[index]
        logprobs = builder.delta(c.token_ids, c.logprobs) if builder is not None else None
        return index, logprobs

    # ------------------------------------------------------------------ streaming
    async def chunks(self, stream: OutputStream) -> AsyncIterator[dict]:
        if self.body.echo:
            yield self._envelope([{"index": i, "text": t, "logprobs": None, "finish_reason": None}
                                  for i, t in enumerate(self.echo)])
        async for prompt_index, out in stream:
            self.usage.add(prompt_index, out)
            choices = []
            for c in out.outputs:
                index, logprobs = self._choice_delta(prompt_index, c)
                if c.text or c.finish_reason or (logprobs and logprobs["tokens"]):
                    choices.append({"index": index, "text": c.text, "logprobs": logprobs, **finish_fields(c)})
            if choices:
                yield self._envelope(choices)
        if self.body.include_usage:
            yield {**self._envelope([]), "usage": self.usage.as_dict()}

    # ------------------------------------------------------------------ one response
    async def collect(self, params, arrival: float) -> Response:
        stream = await self.ctx.generate(self.prompts, params, self.id, arrival)
        num_choices = len(self.prompts) * self.body.n
        texts = list(self.echo)
        logprob_parts: list[list[dict]] = [[] for _ in range(num_choices)]
        finals: list[dict] = [{} for _ in range(num_choices)]
        try:
            async for prompt_index, out in stream:
                self.usage.add(prompt_index, out)
                for c in out.outputs:
                    index, logprobs = self._choice_delta(prompt_index, c)
                    texts[index] += c.text
                    if logprobs:
                        logprob_parts[index].append(logprobs)
                    if c.finish_reason:
                        finals[index] = finish_fields(c)
        except EngineStepError as err:
            return engine_failure_response(self.id, err)
        finally:
            stream.close()
        if aborted_by_shutdown(self.ctx, finals):
            return JSONResponse(error_body(503, "the server shut down before the request finished"), 503)
        choices = [{"index": i, "text": texts[i],
                    "logprobs": merge_completion_logprobs(logprob_parts[i]) if self.logprobs[i] else None,
                    **finals[i]} for i in range(num_choices)]
        return JSONResponse({**self._envelope(choices), "usage": self.usage.as_dict()})
