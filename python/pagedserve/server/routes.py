"""The HTTP routes. Each is thin: parse, check, hand over to a serving module."""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from pagedserve.engine.validation import check_text, check_token_ids
from pagedserve.server.context import ServerContext
from pagedserve.server.chat_inputs import chat_prompt, choose_template, uses_tools
from pagedserve.server.engine_inputs import require_tokenizer
from pagedserve.server.tools.tool_choice import check_tools
from pagedserve.server.engine_state import read_engine_state
from pagedserve.server.errors import bad_request
from pagedserve.server.metrics import CONTENT_TYPE_LATEST
from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pagedserve.server.serving_chat import create_chat_completion
from pagedserve.server.serving_completions import create_completion

PAGE = Path(__file__).resolve().parent / "static" / "index.html"


def add_routes(app: FastAPI, ctx: ServerContext) -> None:
    router = APIRouter()

    @router.get("/health")
    async def health() -> JSONResponse:
        if ctx.load_error is not None:
            return JSONResponse({"status": "failed", "error": ctx.load_error}, status_code=503)
        if ctx.async_engine.dead_error is not None:
            return JSONResponse({"status": "failed", "error": f"engine failed: {ctx.async_engine.dead_error}"},
                                status_code=503)
        if ctx.async_engine.stopping:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        if ctx.async_engine.failed:
            return JSONResponse({"status": "failed", "error": "the engine loop stopped"}, status_code=503)
        if not ctx.async_engine.ready or ctx.info is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.get("/ping")
    async def ping() -> JSONResponse:
        return await health()

    @router.post("/ping")
    async def ping_post() -> JSONResponse:  # vLLM answers both, as SageMaker sends POST
        return await health()

    @router.get("/version")
    async def version() -> JSONResponse:
        from pagedserve import __version__
        return JSONResponse({"version": __version__})

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": int(ctx.started_at), "owned_by": "pagedserve",
                "root": ctx.served_model_name, "parent": None, "max_model_len": ctx.limits.max_model_len}

    @router.get("/v1/models")
    async def models() -> JSONResponse:
        ctx.require_ready()
        return JSONResponse({"object": "list", "data": [model_card(n) for n in ctx.served_model_names]})

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        ctx.require_ready()
        ctx.check_model(model_id)
        return JSONResponse(model_card(model_id))

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(ctx, body, request)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(ctx, body, request)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        return JSONResponse(_tokenize(ctx, body))

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        ctx.require_ready()
        ctx.check_model(body.model)
        check_token_ids(body.tokens, ctx.limits.vocab_size, "tokens")  # a RequestError is a 400 (errors.py)
        require_tokenizer(ctx.tokenizer, "/detokenize")
        return JSONResponse({"prompt": ctx.tokenizer.decode(body.tokens)})

    @router.get("/metrics")
    async def metrics() -> Response:
        data = ctx.metrics.render() if ctx.metrics is not None else b""
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    @router.get("/v1/engine/state")
    async def engine_state() -> JSONResponse:
        ctx.require_ready()
        state = await ctx.async_engine.read(read_engine_state)
        state.update(model=ctx.served_model_name, device=ctx.device, max_model_len=ctx.limits.max_model_len,
                     default_sampling=ctx.default_sampling, num_waiting_total=ctx.async_engine.num_waiting,
                     max_num_waiting=ctx.async_engine.max_num_waiting, uptime_s=time.time() - ctx.started_at)
        return JSONResponse(state)

    @router.get("/")
    async def page() -> FileResponse:
        return FileResponse(PAGE, media_type="text/html")

    app.include_router(router)


def _tokenize(ctx: ServerContext, body: TokenizeRequest) -> dict:
    from pagedserve.engine.tokenizer import encode_prompt

    ctx.require_ready()
    ctx.check_model(body.model)
    require_tokenizer(ctx.tokenizer, "/tokenize")
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send exactly one of 'prompt' and 'messages'")
    if body.prompt is not None:
        check_text(body.prompt, "prompt")
        ids = encode_prompt(ctx.tokenizer, body.prompt) if body.add_special_tokens else \
            list(ctx.tokenizer.encode(body.prompt, add_special_tokens=False))
    else:
        if body.tools:
            check_tools(body.tools)
        template = choose_template(ctx.chat_template, ctx.tokenizer, uses_tools(body))
        ids = chat_prompt(body, ctx.tokenizer, template, body.tools)["prompt_token_ids"]
    return {"count": len(ids), "max_model_len": ctx.limits.max_model_len, "tokens": ids,
            "token_strs": ctx.tokenizer.convert_ids_to_tokens(ids)}
