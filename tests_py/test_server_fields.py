"""The rest of what vLLM users send (issue 12): /version, /ping, GET /v1/models/{id}, model
aliases, CORS, logit_bias / allowed_token_ids / bad_words, chat template options, and a 400
naming every request field the server does not implement (the README's table is the list).

The app runs in process over the fake engine (tests_py/fake_engine.py), except where a
test says it needs the real model."""

from __future__ import annotations

import httpx
import pytest

from fake_engine import FakeEngine
from test_server_inputs import error_of, run_app

from pagedserve import __version__
from pagedserve.server.args import parse_allowed_origins, served_model_names


def run(body, **ctx_options):
    return run_app(FakeEngine(), body, **ctx_options)


# ---------------------------------------------------------------------------- endpoints
def test_version_and_ping():
    async def body(client: httpx.AsyncClient):
        version = await client.get("/version")
        assert version.status_code == 200 and version.json() == {"version": __version__}
        for method in ("GET", "POST"):
            ping = await client.request(method, "/ping")
            assert ping.status_code == 200 and ping.json() == {"status": "ok"}
    run(body)


def test_ping_and_version_need_no_api_key():
    async def body(client: httpx.AsyncClient):
        assert (await client.get("/ping")).status_code == 200
        assert (await client.get("/version")).status_code == 200
        assert (await client.get("/v1/models/fake")).status_code == 401
    run(body, api_key="k")


def test_model_aliases_are_listed_and_accepted():
    async def body(client: httpx.AsyncClient):
        listed = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in listed] == ["main", "alias-a", "org/alias-b"]
        for name in ("main", "alias-a", "org/alias-b"):
            card = await client.get(f"/v1/models/{name}")
            assert card.status_code == 200 and card.json()["id"] == name and card.json()["object"] == "model"
            done = await client.post("/v1/completions", json={"model": name, "prompt": "abc", "max_tokens": 2})
            assert done.status_code == 200, done.text
            assert done.json()["model"] == "main"
        missing = await client.get("/v1/models/nope")
        err = error_of(missing, 404)
        assert err["code"] == "model_not_found" and err["param"] == "model" and "nope" in err["message"]
        err = error_of(await client.post("/v1/completions", json={"model": "nope", "prompt": "a"}), 404)
        assert err["code"] == "model_not_found"
    run(body, served_model_name="main", model_aliases=["alias-a", "org/alias-b"])


def test_served_model_name_and_allowed_origins_flags():
    from pagedserve.server.args import add_server_args, check_server_args, with_server_defaults
    import argparse
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    args = parser.parse_args(["--served-model-name", "a", "b", "--allowed-origins", "http://x.test, http://y.test"])
    assert served_model_names(args.served_model_name) == ["a", "b"]
    assert parse_allowed_origins(args.allowed_origins) == ["http://x.test", "http://y.test"]
    defaults = parser.parse_args([])
    assert served_model_names(defaults.served_model_name) == [] and defaults.allowed_origins is None
    assert served_model_names("one") == ["one"]
    with pytest.raises(ValueError, match="--served-model-name"):
        check_server_args(with_server_defaults(argparse.Namespace(served_model_name=[" "])))


def test_no_cors_headers_by_default():
    async def body(client: httpx.AsyncClient):
        r = await client.get("/v1/models", headers={"Origin": "http://app.test"})
        assert "access-control-allow-origin" not in r.headers
        pre = await client.options("/v1/chat/completions", headers={
            "Origin": "http://app.test", "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in pre.headers
    run(body)


def test_cors_with_an_api_key_answers_preflight_without_the_key():
    async def body(client: httpx.AsyncClient):
        pre = await client.options("/v1/chat/completions", headers={
            "Origin": "http://app.test", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert pre.status_code == 200, pre.text
        assert pre.headers["access-control-allow-origin"] == "http://app.test"
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        denied = await client.get("/v1/models", headers={"Origin": "http://app.test"})
        assert denied.status_code == 401
        ok = await client.get("/v1/models", headers={"Origin": "http://app.test", "Authorization": "Bearer k"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://app.test"
        other = await client.options("/v1/models", headers={
            "Origin": "http://evil.test", "Access-Control-Request-Method": "GET"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    run(body, api_key="k", allowed_origins=["http://app.test"])


# ---------------------------------------------------------------------------- the real server (default model)
# A template that shows what it was given: kwargs (enable_thinking) and the generation prompt.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking %}<think>{% endif %}"
            "{% endif %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from server_process import ServerProcess

    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    with ServerProcess("--max-num-seqs", "4", "--served-model-name", "smol", "smol-alias",
                       "--chat-template", str(template), "--allowed-origins", "http://app.test") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


PROMPT = "The capital of France is"


def test_the_flags_reach_the_real_server(server):
    names = [m["id"] for m in httpx.get(server.base_url + "/models").json()["data"]]
    assert names == ["smol", "smol-alias"]
    assert httpx.get(server.base_url + "/models/smol-alias").json()["id"] == "smol-alias"
    assert httpx.get(server.url + "/version").json() == {"version": __version__}
    pre = httpx.options(server.base_url + "/completions", headers={
        "Origin": "http://app.test", "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://app.test"


def test_logit_bias_allowed_token_ids_and_bad_words_over_the_api(server, client):
    plain = client.completions.create(model="smol", prompt=PROMPT, max_tokens=4, temperature=0,
                                      logprobs=0, extra_body={"ignore_eos": True})
    first = plain.choices[0].logprobs.tokens[0]
    first_id = httpx.post(server.url + "/tokenize", json={"prompt": first, "add_special_tokens": False}
                          ).json()["tokens"][0]
    forced = client.completions.create(model="smol-alias", prompt=PROMPT, max_tokens=3, temperature=0,
                                       logit_bias={str(first_id + 1): 100}, extra_body={"ignore_eos": True})
    assert httpx.post(server.url + "/detokenize", json={"tokens": [first_id + 1] * 3}
                      ).json()["prompt"] == forced.choices[0].text
    allowed = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Say hi"}], max_completion_tokens=3, temperature=0,
        extra_body={"allowed_token_ids": [first_id], "ignore_eos": True})
    assert allowed.choices[0].message.content == first * 3
    assert allowed.usage.completion_tokens == 3  # max_completion_tokens works
    banned = client.completions.create(model="smol", prompt=PROMPT, max_tokens=4, temperature=0,
                                       extra_body={"bad_words": [first.strip()], "ignore_eos": True})
    assert first.strip() not in banned.choices[0].text.split()


@pytest.mark.parametrize("extra, field", [
    ({"logit_bias": {"999999": 1}}, "logit_bias"), ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": ["\ud800"]}, "bad_words"),
])
def test_bad_logits_processor_values_are_400s_naming_the_field(server, extra, field):
    r = httpx.post(server.base_url + "/completions", timeout=60,
                   content=__import__("json").dumps({"prompt": PROMPT, "max_tokens": 2, **extra}),
                   headers={"Content-Type": "application/json"})
    err = error_of(r, 400)
    assert err["param"] == field, err


# ---------------------------------------------------------------------------- chat options
def rendered(server, **body) -> tuple[str, int]:
    r = httpx.post(server.url + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    return httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"], len(ids)


USER = [{"role": "user", "content": "Name a colour."}]


def test_chat_template_flag_and_chat_template_kwargs(server, client):
    text, _ = rendered(server, messages=USER)
    assert text == "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"
    thinking, count = rendered(server, messages=USER, chat_template_kwargs={"enable_thinking": True})
    assert thinking.endswith("<|im_start|>assistant\n<think>")
    out = client.chat.completions.create(model="smol", messages=USER, max_tokens=2, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert out.usage.prompt_tokens == count
    no_prompt, _ = rendered(server, messages=USER, add_generation_prompt=False)
    assert no_prompt == "<|im_start|>user\nName a colour.<|im_end|>\n"


def test_continue_final_message(server, client):
    conversation = USER + [{"role": "assistant", "content": "My favourite colour is"}]
    text, count = rendered(server, messages=conversation, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nMy favourite colour is")
    out = client.chat.completions.create(model="smol", messages=conversation, max_tokens=3, temperature=0,
                                         extra_body={"continue_final_message": True})
    assert out.usage.prompt_tokens == count and out.choices[0].message.content


@pytest.mark.parametrize("extra, field", [
    ({"continue_final_message": True}, "continue_final_message"),  # the last message is the user's
    ({"continue_final_message": True, "add_generation_prompt": True,
      "messages": USER + [{"role": "assistant", "content": "x"}]}, "continue_final_message"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
])
def test_bad_chat_options_are_400s_naming_the_field(server, extra, field):
    r = httpx.post(server.base_url + "/chat/completions", json={"messages": USER, "max_tokens": 2, **extra},
                   timeout=60)
    assert error_of(r, 400)["param"] == field


def test_chat_template_file_must_exist(tmp_path):
    from pagedserve.cli_args import read_chat_template

    assert read_chat_template(None) is None
    assert read_chat_template("{{ messages }}") == "{{ messages }}"
    (tmp_path / "t.jinja").write_text("T")
    assert read_chat_template(str(tmp_path / "t.jinja")) == "T"
    with pytest.raises(ValueError, match="--chat-template"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_chat_cli_and_serve_take_chat_template():
    from pagedserve.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["chat", "--chat-template", "f.jinja"]).chat_template == "f.jinja"
    assert parser.parse_args(["serve", "--chat-template", "f.jinja"]).chat_template == "f.jinja"
    assert parser.parse_args(["generate", "hi", "--chat-template"]).chat_template is True


# ---------------------------------------------------------------------------- the README's table of fields
README = __import__("pathlib").Path(__file__).resolve().parents[1] / "README.md"
# Values for the refused rows whose field exists but is refused for some values; any other refused
# field is unknown to the server, so any value is refused.
REFUSED_VALUES = {
    "suffix": "tail", "best_of": 2, "echo": True, "logprobs": 1,
}
BASE_BODIES = {"completions": {"prompt": "abc", "max_tokens": 2},
               "chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}


def field_table() -> list[tuple[list[str], list[str], str]]:
    """(fields, endpoints, status) of each row of README.md's "OpenAI and vLLM request fields" table."""
    import re

    text = README.read_text()
    section = text[text.index("### OpenAI and vLLM request fields"):]
    section = section[:section.index("\n#", 1)]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        names = re.findall(r"`([a-z_]+)`", cells[0])
        endpoints = ["completions", "chat"] if cells[1] == "both" else [cells[1]]
        assert set(endpoints) <= set(BASE_BODIES) and cells[2] in ("accepted", "400"), line
        rows.append((names, endpoints, cells[2]))
    assert len(rows) > 30
    return rows


def test_every_field_marked_400_in_the_readme_is_a_400_naming_it():
    cases = [(names, endpoint) for names, endpoints, status in field_table() if status == "400"
             for endpoint in endpoints]

    async def body(client: httpx.AsyncClient):
        failures = []
        for names, endpoint in cases:
            path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
            # "`echo` with `logprobs`" is one case; a row listing several fields is one case per field.
            groups = [names] if len(names) == 2 and names == ["echo", "logprobs"] else [[n] for n in names]
            for group in groups:
                sent = {**BASE_BODIES[endpoint], **{n: REFUSED_VALUES.get(n, 1) for n in group}}
                r = await client.post(path, json=sent)
                param = r.json().get("error", {}).get("param") if r.status_code == 400 else None
                if r.status_code != 400 or param != group[0]:
                    failures.append((endpoint, group, r.status_code, r.text[:200]))
        assert not failures, failures
    run(body)


def test_every_accepted_field_is_in_the_readme_and_known_to_the_server():
    from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest

    accepted = {"completions": set(), "chat": set()}
    for names, endpoints, status in field_table():
        for endpoint in endpoints:
            if status == "accepted":
                accepted[endpoint].update(names)
    for endpoint, model in (("completions", CompletionRequest), ("chat", ChatCompletionRequest)):
        known = set(model.model_fields)
        assert known == accepted[endpoint], (endpoint, known ^ accepted[endpoint])


def test_accepted_fields_pass_and_null_unknown_fields_are_dropped():
    async def body(client: httpx.AsyncClient):
        ok = await client.post("/v1/completions", json={
            "prompt": "abc", "max_tokens": 2, "user": "u1", "logit_bias": {"1": 5}, "allowed_token_ids": [1, 2],
            "suffix": "", "best_of": 1, "echo": True, "functions": None})
        assert ok.status_code == 200, ok.text
        ok = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi", "refusal": None}], "max_completion_tokens": 2,
            "tool_choice": "none", "tools": []})
        assert ok.status_code == 200, ok.text
        err = error_of(await client.post("/v1/chat/completions", json={"messages": [
            {"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]}))
        assert err["param"] == "messages" and "tool_calls[0]" in err["message"]
        err = error_of(await client.post("/v1/chat/completions", json={"messages": [
            {"role": "user", "content": "x", "reasoning": "y"}]}))
        assert err["param"] == "messages.0.reasoning" and "not supported" in err["message"]
    run(body)
