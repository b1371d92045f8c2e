"""The HTTP app over the fake engine, in process (no sockets, no model): the
server reaches the engine only through EngineClient, checks requests with
the engine's own rules, takes sampling defaults from the engine's info,
reports cached prompt tokens, is strict about types, and answers 500s
without exception text."""

from __future__ import annotations

import ast
import asyncio
import json
from pathlib import Path

import httpx
import pytest

from fake_engine import SECRET, FakeEngine, ProtocolOnly
from pagedserve.server.app import attach_engine, build_app
from pagedserve.server.async_engine import AsyncEngine
from pagedserve.server.context import ServerContext

SERVER_DIR = Path(__file__).resolve().parents[1] / "python" / "pagedserve" / "server"
DEFAULTS = {"temperature": 0.3, "top_p": 0.8, "top_k": 7, "min_p": 0.05, "repetition_penalty": 1.2}


def run_app(engine: FakeEngine, body, max_num_waiting: int = 64, **ctx_options):
    """Runs `body(client)` against the app over `engine` (seen through EngineClient only)."""

    async def main():
        ctx = ServerContext(AsyncEngine(max_num_waiting), **ctx_options)
        app = build_app(ctx)
        attach_engine(ctx, ProtocolOnly(engine), asyncio.get_running_loop())
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
                return await body(client)
        finally:
            ctx.async_engine.begin_shutdown()
            assert await asyncio.to_thread(ctx.async_engine.join, 10)
    return asyncio.run(main())


def error_of(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_nothing_under_server_reaches_past_the_engine_client():
    """The engine's insides are not named anywhere in server/ (the fake refuses them at run time too)."""
    forbidden = {"worker", "scheduler", "requests", "model_config", "get_num_unfinished_requests",
                 "request_id_of"}
    for path in SERVER_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "engine":
                assert node.attr not in forbidden | {"config", "tokenizer"}, f"{path.name}: engine.{node.attr}"
            if isinstance(node, ast.Attribute):
                assert node.attr not in forbidden, f"{path.name}:{node.lineno}: .{node.attr}"


def test_server_modules_stay_small():
    for path in SERVER_DIR.glob("*.py"):
        assert len(path.read_text().splitlines()) <= 300, path.name


def test_fields_left_out_take_the_models_defaults():
    engine = FakeEngine(default_sampling=DEFAULTS)

    async def body(client):
        plain = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        chat = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                "max_tokens": 2})
        explicit = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "temperature": 1.0,
                                                              "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                                              "repetition_penalty": 1.0})
        state = (await client.get("/v1/engine/state")).json()
        return [r.json()["id"] for r in (plain, chat, explicit)], state

    (plain, chat, explicit), state = run_app(engine, body)
    for rid in (plain, chat):
        p = engine.added_params[rid]
        assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == tuple(DEFAULTS.values())
    p = engine.added_params[explicit]
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)
    assert state["default_sampling"] == DEFAULTS  # what the page shows as its placeholders


def test_usage_reports_the_prompt_tokens_the_prefix_cache_held():
    engine = FakeEngine(block_size=4)
    text = "a shared prefix of several blocks"
    chat_body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2}

    async def body(client):
        first = (await client.post("/v1/completions", json={"prompt": text, "max_tokens": 2})).json()
        second = (await client.post("/v1/completions", json={"prompt": text, "max_tokens": 2})).json()
        chat1 = (await client.post("/v1/chat/completions", json=chat_body)).json()
        chat2 = (await client.post("/v1/chat/completions", json=chat_body)).json()
        stream = await client.post("/v1/chat/completions", json={**chat_body, "stream": True,
                                                                 "stream_options": {"include_usage": True}})
        events = [json.loads(line[6:]) for line in stream.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        return first, second, chat1, chat2, events[-1]["usage"]

    first, second, chat1, chat2, streamed = run_app(engine, body)
    cached = (len(text) - 1) // 4 * 4
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
    assert chat1["usage"]["prompt_tokens_details"]["cached_tokens"] < chat2["usage"]["prompt_tokens_details"][
        "cached_tokens"] == streamed["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize("field, value", [("max_tokens", "2"), ("stream", "yes"), ("n", "1"), ("temperature", "0.5"),
                                          ("echo", 1), ("max_tokens", 2.0)])
def test_types_are_strict(field, value):
    async def body(client):
        return await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value})

    error = error_of(run_app(FakeEngine(), body))
    assert error["param"] == field and field in error["message"]


@pytest.mark.parametrize("field, value", [
    ("stop_token_ids", [2**31]), ("stop_token_ids", [2**63]), ("max_tokens", 10**20), ("n", 2**40), ("top_k", 2**31),
    ("min_tokens", 2**33), ("logprobs", 2**31), ("prompt", [1, 2**31]), ("seed", 2**70)])
def test_out_of_range_integers_are_readable_400s(field, value):
    async def body(client):
        return await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value})

    error = error_of(run_app(FakeEngine(), body))
    assert error["param"] == field, error
    assert "incompatible" not in error["message"] and "(self" not in error["message"]


def test_lone_surrogates_and_bad_token_ids_are_400s_naming_the_field():
    async def body(client):
        return [await client.post(path, content=payload, headers={"Content-Type": "application/json"})
                for path, payload in (
                    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}'),
                    ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}'),
                    ("/v1/completions", '{"prompt": "ok", "stop": ["\\ud800"], "max_tokens": 2}'),
                    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
                    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", '
                                             '"text": "\\ud83d"}]}]}'),
                    ("/tokenize", '{"prompt": "a\\ud800b"}'),
                    ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}'),
                    ("/v1/completions", '{"model": "\\ud800", "prompt": "x"}'),
                    ("/detokenize", '{"tokens": [1, 300]}'))]

    responses = run_app(FakeEngine(), body)
    params = ["prompt", "prompt", "stop", "messages", "messages", "prompt", "messages", "model", "tokens"]
    for response, param in zip(responses, params, strict=True):
        status = 404 if param == "model" else 400
        error = error_of(response, status)
        assert error["param"] == param, error
        if status == 400 and param != "tokens":
            assert error["code"] == "invalid_text" and "surrogate" in error["message"]


def test_a_call_that_can_never_fit_the_waiting_bound_is_a_400():
    async def body(client):
        many = await client.post("/v1/completions", json={"prompt": ["x"] * 5, "max_tokens": 2})
        wide = await client.post("/v1/completions", json={"prompt": ["x", "y"], "n": 3, "max_tokens": 2})
        fits = await client.post("/v1/completions", json={"prompt": ["x", "y"], "n": 2, "max_tokens": 2})
        return many, wide, fits

    many, wide, fits = run_app(FakeEngine(max_num_seqs=4), body, max_num_waiting=4)
    for response in (many, wide):
        error = error_of(response)
        assert error["code"] == "too_many_sequences" and "max-num-waiting" in error["message"]
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 4


def test_500s_name_an_error_id_and_never_the_exception():
    engine = FakeEngine(step_seconds=0.001, fail_prompt="boom")

    async def body(client):
        step = await client.post("/v1/completions", json={"prompt": "boom", "max_tokens": 5})
        streamed = await client.post("/v1/completions", json={"prompt": "boom", "max_tokens": 5, "stream": True})
        tokenizer = await client.post("/v1/completions", json={"prompt": "x <crash> y", "max_tokens": 5})
        after = await client.post("/v1/completions", json={"prompt": "fine", "max_tokens": 2})
        return step, streamed, tokenizer, after

    step, streamed, tokenizer, after = run_app(engine, body)
    for response in (step, tokenizer):
        error = error_of(response, 500)
        assert error["type"] == "server_error" and "err-" in error["message"]
        assert SECRET not in response.text and "RuntimeError" not in response.text
    assert streamed.status_code == 200 and '"server_error"' in streamed.text and "err-" in streamed.text
    assert SECRET not in streamed.text and streamed.text.rstrip().endswith("data: [DONE]")
    assert after.status_code == 200


def test_the_api_key_guards_the_docs_and_accepts_any_case_of_bearer():
    async def body(client):
        codes = {}
        for path in ("/docs", "/openapi.json", "/v1/models"):
            codes[path] = [(await client.get(path, headers=headers)).status_code for headers in (
                {}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer k3y"},
                {"Authorization": "bearer k3y"}, {"Authorization": "BEARER  k3y "})]
        models = (await client.get("/v1/models", headers={"Authorization": "Bearer k3y"})).json()
        return codes, models

    codes, models = run_app(FakeEngine(), body, api_key="k3y")
    assert all(c == [401, 401, 200, 200, 200] for c in codes.values()), codes
    entry = models["data"][0]
    assert entry["id"] == entry["root"] == "fake-model" and "/" not in json.dumps(entry)


@pytest.mark.parametrize("host, allowed", [
    ("127.0.0.1:8000", True), ("localhost:8000", True), ("LOCALHOST", True), ("[::1]:8000", True),
    ("10.1.2.3", True), ("app.localhost", True), ("my.box:8000", True), ("evil.example", False),
    ("evil.example:8000", False), ("127.0.0.1.evil.example", False)])
def test_without_a_key_only_local_or_allowed_host_headers_are_answered(host, allowed):
    async def body(client):
        return await client.get("/health", headers={"Host": host})

    from pagedserve.server.middleware import parse_allowed_hosts
    response = run_app(FakeEngine(), body, allowed_hosts=parse_allowed_hosts("my.box", "127.0.0.1"))
    if allowed:
        assert response.status_code == 200
    else:
        assert error_of(response)["code"] == "host_not_allowed"


def test_a_lone_surrogate_never_reaches_the_log_as_a_traceback(caplog):
    async def body(client):
        return await client.post("/v1/completions", content='{"prompt": "a\\ud800b"}',
                                 headers={"Content-Type": "application/json"})

    with caplog.at_level("INFO"):
        assert run_app(FakeEngine(), body).status_code == 400
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
