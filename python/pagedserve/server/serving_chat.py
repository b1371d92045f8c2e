"""POST /v1/chat/completions: the conversation goes through the chat template
(with the request's tools); the reply streams as chat.completion.chunk deltas
or comes back as one chat.completion, its text read by the reasoning parser
and the tool plan (chat_choice.py)."""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.server.async_engine import EngineStepError, OutputStream
from pagedserve.server.chat_choice import ASSISTANT, ChatChoice
from pagedserve.server.chat_inputs import chat_logprobs, chat_prompt, check_chat_options, choose_template, uses_tools
from pagedserve.server.context import ServerContext
from pagedserve.server.engine_inputs import check_prompts, sampling_params, structured_outputs
from pagedserve.server.errors import error_body
from pagedserve.server.logprobs import chat_logprobs as chat_logprob_content
from pagedserve.server.protocol import ChatCompletionRequest
from pagedserve.server.reasoning import REASONING_PARSERS
from pagedserve.server.serving_common import (Usage, aborted_by_shutdown, client_gone, engine_failure_response,
                                              finish_fields, sse_events)
from pagedserve.server.streaming import sse_response, until_disconnected
from pagedserve.server.tools.parsers import parser_for
from pagedserve.server.tools.tool_choice import ToolPlan, plan_tools


async def create_chat_completion(ctx: ServerContext, body: ChatCompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    ctx.require_ready()
    ctx.check_model(body.model)
    check_chat_options(body)
    template = choose_template(ctx.chat_template, ctx.tokenizer, uses_tools(body))
    user_spec = structured_outputs(body)
    plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                      parser_for(ctx.tool_call_parser, ctx.architecture, template.shipped),
                      user_grammar=user_spec is not None)
    prompt = chat_prompt(body, ctx.tokenizer, template, plan.tools if plan else None)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = chat_logprobs(body)
    spec = StructuredOutputsParams(**plan.grammar) if plan and plan.grammar else user_spec  # tool_choice's wins
    params = sampling_params(body, max_tokens, logprobs, ctx.default_sampling, spec)
    check_prompts([prompt], params, ctx.limits, "messages")
    call = _ChatCompletion(ctx, body, prompt, f"chatcmpl-{uuid.uuid4().hex}", logprobs, plan)
    if body.stream:
        stream = await ctx.generate([prompt], params, call.id, arrival, "messages")
        return sse_response(sse_events(call.id, stream, call.chunks(stream)))
    result = await until_disconnected(request, call.collect(params, arrival))
    return client_gone() if result is None else result


class _ChatCompletion:
    def __init__(self, ctx: ServerContext, body: ChatCompletionRequest, prompt: dict, call_id: str,
                 logprobs: Optional[int], plan: Optional[ToolPlan]):
        self.ctx = ctx
        self.body = body
        self.prompt = prompt
        self.id = call_id
        self.logprobs = logprobs
        self.created = int(time.time())
        self.usage = Usage(prompt_tokens=len(prompt["prompt_token_ids"]))
        reasoning = REASONING_PARSERS[ctx.reasoning_parser] if ctx.reasoning_parser else None
        self.choices = [ChatChoice(reasoning, plan) for _ in range(body.n)]

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.ctx.served_model_name,
                "system_fingerprint": None, "choices": choices}

    def _logprobs(self, c) -> Optional[list[dict]]:
        if self.logprobs is None:
            return None
        return chat_logprob_content(c.token_ids, c.logprobs, self.logprobs)

    def _finish(self, c) -> dict:
        fields = finish_fields(c)
        return {**fields, "finish_reason": self.choices[c.index].finish_reason(fields["finish_reason"])}

    # ------------------------------------------------------------------ streaming
    async def chunks(self, stream: OutputStream) -> AsyncIterator[dict]:
        chunk = "chat.completion.chunk"
        # Every choice opens with its role, as OpenAI's streams do.
        yield self._envelope(chunk, [{"index": i, "delta": {"role": ASSISTANT, "content": ""},
                                      "logprobs": None, "finish_reason": None} for i in range(self.body.n)])
        async for _, out in stream:
            self.usage.add(0, out)
            content, finished = [], []
            for c in out.outputs:
                logprobs = self._logprobs(c)
                choice = self.choices[c.index]
                delta = choice.feed(c.text, final=bool(c.finish_reason))
                if delta or logprobs:
                    content.append({"index": c.index, "delta": delta,
                                    "logprobs": {"content": logprobs} if logprobs is not None else None,
                                    "finish_reason": None})
                if c.finish_reason:
                    finished.append({"index": c.index, "delta": {}, "logprobs": None, **self._finish(c)})
            for choices in (content, finished):
                if choices:
                    yield self._envelope(chunk, choices)
        if self.body.include_usage:
            yield {**self._envelope(chunk, []), "usage": self.usage.as_dict()}

    # ------------------------------------------------------------------ one response
    async def collect(self, params, arrival: float) -> Response:
        stream = await self.ctx.generate([self.prompt], params, self.id, arrival, "messages")
        n = self.body.n
        logprobs: list[list[dict]] = [[] for _ in range(n)]
        finals: list[dict] = [{} for _ in range(n)]
        try:
            async for _, out in stream:
                self.usage.add(0, out)
                for c in out.outputs:
                    self.choices[c.index].feed(c.text, final=bool(c.finish_reason))
                    logprobs[c.index] += self._logprobs(c) or []
                    if c.finish_reason:
                        finals[c.index] = self._finish(c)
        except EngineStepError as err:
            return engine_failure_response(self.id, err)
        finally:
            stream.close()
        if aborted_by_shutdown(self.ctx, finals):
            return JSONResponse(error_body(503, "the server shut down before the request finished"), 503)
        choices = [{"index": i, "message": self.choices[i].message(),
                    "logprobs": {"content": logprobs[i]} if self.logprobs is not None else None, **finals[i]}
                   for i in range(n)]
        return JSONResponse({**self._envelope("chat.completion", choices), "usage": self.usage.as_dict()})
