"""Bad input, missing keys, a full queue and clients that leave: each gets an
OpenAI-style error (or a clean abort), and the engine keeps serving.

The server runs with an API key, a 64 KiB body limit, one sequence per batch
and room for two waiting requests, so the queue fills with three requests.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from server_process import ServerProcess

API_KEY = "test-key-5b1e"
MAX_REQUEST_BYTES = 65536
PROMPT = "The capital of France is"
LONG_GENERATION = {"max_tokens": 400, "ignore_eos": True}  # tens of seconds on a CPU: only aborts end it early


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-num-seqs", "1", "--max-num-waiting", "2", "--max-request-bytes",
                       str(MAX_REQUEST_BYTES), api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def expect_error(call, status: int, param=None, match: str = "") -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    err = info.value
    assert err.status_code == status, err.message
    assert set(err.body) == {"message", "type", "param", "code"}, err.body
    assert isinstance(err.body["message"], str) and err.body["message"]
    assert match.lower() in err.body["message"].lower(), err.body["message"]
    if param is not None:
        assert err.param == param, err.body
    return err


def raw_post(server, path: str, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}", **kw.pop("headers", {})}
    return httpx.post(server.url + path, headers=headers, timeout=kw.pop("timeout", 60), **kw)


def assert_serving(client, model) -> None:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0)
    assert out.usage.completion_tokens >= 1


# ---------------------------------------------------------------------------- authentication
def test_api_key_is_required_on_the_api_but_not_on_health_or_metrics(server, model):
    wrong = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    err = expect_error(lambda: wrong.completions.create(model=model, prompt=PROMPT, max_tokens=2), 401,
                       match="API key")
    assert err.type == "authentication_error" and err.code == "invalid_api_key"
    assert httpx.get(server.base_url + "/models").status_code == 401
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


# ---------------------------------------------------------------------------- malformed bodies
def test_invalid_json_and_wrong_shapes(server):
    bad_json = raw_post(server, "/v1/completions", content=b'{"prompt": "x", ', headers={"Content-Type":
                                                                                         "application/json"})
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    not_object = raw_post(server, "/v1/chat/completions", json=[1, 2, 3])
    assert not_object.status_code == 400 and not_object.json()["error"]["type"] == "invalid_request_error"
    missing = raw_post(server, "/v1/completions", json={"max_tokens": 3})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("field, value", [
    ("max_tokens", "many"), ("temperature", "hot"), ("n", 1.5), ("stream", "maybe"), ("stop", 42),
    ("seed", "abc"), ("logprobs", [1]), ("prompt", {"text": "x"}),
])
def test_fields_of_the_wrong_type(server, field, value):
    body = {"prompt": PROMPT, "max_tokens": 3, field: value}
    response = raw_post(server, "/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] is not None and error["param"].split(".")[0] == field and field in error["message"]


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("n", 0), ("max_tokens", 0), ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0), ("top_k", -5), ("min_p", 1.5), ("repetition_penalty", 0.0), ("logprobs", -1),
    ("min_tokens", -1),
])
def test_out_of_range_parameters(client, model, field, value):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 3, field: value}
    expect_error(lambda: client.completions.create(**{k: v for k, v in body.items() if k != field},
                                                   extra_body={field: value}), 400, param=field)


def test_chat_specific_errors(client, model):
    chat = client.chat.completions.create
    expect_error(lambda: chat(model=model, messages=[], max_tokens=3), 400, param="messages", match="empty")
    expect_error(lambda: chat(model=model, messages=[{"role": "wizard", "content": "hi"}], max_tokens=3), 400,
                 match="role")
    expect_error(lambda: chat(model=model, messages=[{"role": "user", "content": "hi"}], logprobs=True,
                              top_logprobs=21), 400, param="top_logprobs")
    expect_error(lambda: chat(model=model, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]), 400, match="text")
    expect_error(lambda: chat(model=model, messages=[{"role": "user", "content": "hi"}], tools=[
        {"type": "function", "function": {"name": "f", "parameters": "none"}}]), 400, param="tools",
                 match="parameters")


def test_unknown_model_is_404(client):
    err = expect_error(lambda: client.completions.create(model="gpt-17", prompt=PROMPT, max_tokens=2), 404,
                       param="model", match="gpt-17")
    assert err.code == "model_not_found"


def test_empty_prompts(client, model):
    expect_error(lambda: client.completions.create(model=model, prompt="", max_tokens=2), 400, param="prompt")
    expect_error(lambda: client.completions.create(model=model, prompt=[], max_tokens=2), 400, param="prompt")
    expect_error(lambda: client.completions.create(model=model, prompt=["ok", ""], max_tokens=2), 400,
                 param="prompt")


def test_context_length_limits(server, client, model):
    max_model_len = server.get("/v1/models").json()["data"][0]["max_model_len"]
    n_prompt = len(server.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"])
    err = expect_error(lambda: client.completions.create(model=model, prompt=PROMPT,
                                                         max_tokens=max_model_len - n_prompt + 1), 400,
                       param="max_tokens", match="max_model_len")
    assert err.code == "context_length_exceeded"
    huge = "word " * (max_model_len + 50)
    expect_error(lambda: client.chat.completions.create(model=model, messages=[{"role": "user", "content": huge}]),
                 400, param="messages", match="max_model_len")
    assert_serving(client, model)


def test_limits_of_n_and_logprobs(client, model):
    expect_error(lambda: client.completions.create(model=model, prompt=PROMPT, max_tokens=2, n=2), 400, param="n",
                 match="max_num_seqs")
    expect_error(lambda: client.completions.create(model=model, prompt=PROMPT, max_tokens=2, logprobs=21), 400,
                 param="logprobs", match="max_logprobs")


def test_unsupported_options(client, model):
    expect_error(lambda: client.completions.create(model=model, prompt=PROMPT, max_tokens=2, logit_bias={"1": 500}),
                 400, param="logit_bias")
    expect_error(lambda: client.completions.create(model=model, prompt=PROMPT, max_tokens=2,
                                                   extra_body={"use_beam_search": True}),
                 400, param="use_beam_search", match="not supported")
    expect_error(lambda: client.completions.create(model=model, prompt=PROMPT, max_tokens=2, suffix="end"), 400,
                 param="suffix")
    expect_error(lambda: client.completions.create(model=model, prompt=[[1, 2, 10 ** 9]], max_tokens=2), 400,
                 match="vocabulary")


def test_oversized_bodies_get_413(server):
    body = {"prompt": "x" * (MAX_REQUEST_BYTES + 10), "max_tokens": 2}
    declared = raw_post(server, "/v1/completions", json=body)
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit must hold while reading
        yield b'{"prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 1024 + 2):
            yield b"y" * 1024
        yield b'", "max_tokens": 2}'
    chunked = raw_post(server, "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413


def test_the_engine_keeps_serving_after_bad_requests(client, model):
    assert_serving(client, model)


# ---------------------------------------------------------------------------- load shedding and disconnects
def test_a_full_waiting_queue_answers_503_with_retry_after(server, client, model):
    streams = []
    try:
        for _ in range(3):  # one runs (max_num_seqs 1), two wait (max_num_waiting 2)
            streams.append(client.completions.create(model=model, prompt=PROMPT, stream=True,
                                                     extra_body=LONG_GENERATION))
        deadline = time.monotonic() + 30
        while len(server.engine_state()["waiting"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        state = server.engine_state()
        assert len(state["running"]) == 1 and len(state["waiting"]) == 2
        err = expect_error(lambda: client.completions.create(model=model, prompt=PROMPT, max_tokens=2), 503,
                           match="retry")
        assert err.response.headers["Retry-After"].isdigit()
    finally:
        for stream in streams:
            stream.close()
    state = server.wait_idle(timeout=30)
    assert state["stats"]["num_used_blocks"] == 0
    assert_serving(client, model)


def test_a_streaming_client_that_disconnects_frees_its_blocks_at_once(server, client, model):
    stream = client.completions.create(model=model, prompt=PROMPT, stream=True, extra_body=LONG_GENERATION)
    for received, _ in enumerate(stream, start=1):
        if received == 3:
            break
    busy = server.engine_state()
    assert len(busy["running"]) == 1 and busy["stats"]["num_used_blocks"] > 0
    stream.close()
    started = time.monotonic()
    state = server.wait_idle(timeout=10)
    assert time.monotonic() - started < 10
    assert state["stats"]["num_used_blocks"] == 0 and state["stats"]["pool_utilization"] == 0.0
    metrics = server.metrics()
    assert metrics["pagedserve:num_requests_running"] == 0 and metrics["pagedserve:kv_cache_usage_perc"] == 0


def test_a_non_streaming_client_that_disconnects_is_aborted(server, client, model):
    aborted_before = _aborted_count(server)
    with pytest.raises(httpx.ReadTimeout):
        raw_post(server, "/v1/completions", json={"model": model, "prompt": PROMPT, **LONG_GENERATION},
                 timeout=httpx.Timeout(60, read=2.0))
    state = server.wait_idle(timeout=10)  # the whole generation would take far longer
    assert state["stats"]["num_used_blocks"] == 0
    assert _aborted_count(server) == aborted_before + 1
    assert_serving(client, model)


def _aborted_count(server) -> float:
    for line in server.get("/metrics").text.splitlines():
        if line.startswith("pagedserve:request_success_total") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---------------------------------------------------------------------------- hostile input (issue 11)
@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}',
     "messages"),
    ("/tokenize", '{"prompt": "a\\ud800b"}', "prompt"),
])
def test_a_lone_surrogate_is_a_400_and_the_connection_stays_open(server, path, body, param):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    try:
        with sock.makefile("rb") as reader:
            for request_body in (body, '{"prompt": "fine"}'):
                data = request_body.encode()
                target = path if request_body == body else "/tokenize"
                sock.sendall(f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
                             f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
                status = int(reader.readline().split()[1])
                headers = {}
                while (line := reader.readline().decode().strip()):
                    key, value = line.split(":", 1)
                    headers[key.lower()] = value.strip()
                payload = reader.read(int(headers["content-length"]))
                if request_body == body:
                    assert status == 400, payload
                    error = json.loads(payload)["error"]
                    assert error["param"] == param and "surrogate" in error["message"], error
                else:
                    assert status == 200  # the same keep-alive connection answers the next request
    finally:
        sock.close()
    assert "Traceback" not in server.log(None)


@pytest.mark.parametrize("field, value", [
    ("stop_token_ids", [2**31]), ("stop_token_ids", [-1]), ("max_tokens", 10**20), ("n", 2**40), ("top_k", 2**31),
    ("prompt", [1, 2**31]), ("max_tokens", "2"), ("stream", "yes"),
])
def test_out_of_range_integers_and_wrong_types_are_readable_400s(server, field, value):
    response = raw_post(server, "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field, error
    assert "incompatible function arguments" not in error["message"] and "_core" not in error["message"]


def test_the_docs_need_the_key_and_models_show_no_path(server):
    for path in ("/docs", "/openapi.json"):
        assert httpx.get(server.url + path).status_code == 401
        assert httpx.get(server.url + path, headers={"Authorization": f"bearer {API_KEY}"}).status_code == 200
    entry = httpx.get(server.base_url + "/models", headers={"Authorization": f"BEARER {API_KEY}"}).json()["data"][0]
    assert entry["root"] == entry["id"] and "/" not in entry["root"]
