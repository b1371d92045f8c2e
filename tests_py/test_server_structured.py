"""Structured outputs through the real server (default model, CPU) and the official `openai` client:
response_format json_schema (streaming and not, n = 2) and json_object, vLLM's structured_outputs and
guided_* fields in extra_body, completions, and the 400s (an uncompilable schema, several kinds at
once, structural_tag). Outputs are checked with json, jsonschema and re."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from server_process import ServerProcess

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "Give me a person as JSON with a name and an age."}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
GREEDY = {"temperature": 0.0, "max_tokens": 96}


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-num-seqs", "8") as s:
        yield s


def test_json_schema_chat(client, model):
    r = client.chat.completions.create(model=model, messages=CHAT, response_format=RESPONSE_FORMAT, n=2,
                                       temperature=0.8, seed=3, max_tokens=96)
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_schema_chat_streaming(client, model):
    stream = client.chat.completions.create(model=model, messages=CHAT, response_format=RESPONSE_FORMAT,
                                            stream=True, **GREEDY)
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_twenty_schemas_streamed_and_not(client, model):
    """Each of the offline test's 20+ schemas through response_format json_schema (strict): every other one
    streamed, every third with n = 2; sent concurrently so the engine batches constrained rows together."""
    from concurrent.futures import ThreadPoolExecutor

    from test_structured_outputs import SCHEMAS

    def ask(i: int) -> list[str]:
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True}}
        kwargs = dict(model=model, messages=[{"role": "user", "content": "Answer with JSON: an example record."}],
                      response_format=fmt, n=2 if i % 3 == 0 else 1, temperature=0.3, seed=i, max_tokens=200)
        if i % 2 == 0:
            return [(c.message.content, c.finish_reason) for c in client.chat.completions.create(**kwargs).choices]
        texts, finish = {}, {}
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
                finish[c.index] = c.finish_reason or finish.get(c.index)
        return [(texts[i], finish[i]) for i in sorted(texts)]

    assert len(SCHEMAS) >= 20
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(len(SCHEMAS))))
    for i, choices in enumerate(results):
        assert len(choices) == (2 if i % 3 == 0 else 1), (i, choices)
        for text, finish in choices:
            assert finish == "stop", (i, text)
            jsonschema.validate(json.loads(text), SCHEMAS[i])


def test_json_object(client, model):
    r = client.chat.completions.create(model=model, messages=CHAT, response_format={"type": "json_object"},
                                       temperature=0.0, max_tokens=128, extra_body={"repetition_penalty": 1.0})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_guided_fields(client, model):
    choices = ["yes", "no"]
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Is the sky blue?"}],
                                       extra_body={"guided_choice": choices}, **GREEDY)
    assert r.choices[0].message.content in choices
    r = client.completions.create(model=model, prompt="Phone:", extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"},
                                  **GREEDY)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].text)
    r = client.completions.create(model=model, prompt="A person:", extra_body={"guided_json": SCHEMA}, **GREEDY)
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = client.completions.create(model=model, prompt="Sum:",
                                  extra_body={"guided_grammar": 'root ::= [1-9] " + " [1-9]'}, **GREEDY)
    assert re.fullmatch(r"[1-9] \+ [1-9]", r.choices[0].text)


def test_structured_outputs_field(client, model):
    r = client.completions.create(model=model, prompt="The capital of France is",
                                  extra_body={"structured_outputs": {"choice": ["Paris", "Rome"]}}, **GREEDY)
    assert r.choices[0].text in ("Paris", "Rome")
    stream = client.completions.create(model=model, prompt="A person:", stream=True,
                                       extra_body={"structured_outputs": {"json": SCHEMA}}, **GREEDY)
    text = "".join(c.choices[0].text for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("extra", [
    {"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}},
    {"guided_regex": "(unclosed"},
    {"guided_grammar": "root ::= nowhere"},
    {"guided_choice": []},
    {"guided_choice": ["a"], "guided_regex": "a"},
    {"structured_outputs": {"structural_tag": {"type": "structural_tag"}}},
    {"structured_outputs": {"json": SCHEMA, "regex": "a"}},
    {"structured_outputs": {"unknown_kind": 1}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
    {"response_format": {"type": "yaml"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "tags", "schema": {
        "type": "array", "items": {"type": "string"}, "uniqueItems": True}}}},  # enforced by no backend here
])
def test_bad_specs_are_400(client, model, extra):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, extra_body=extra)
    assert err.value.status_code == 400
    if "guided_regex" in extra and len(extra) == 1:  # compiled by the engine: the message names the problem
        assert "cannot be compiled" in str(err.value) and err.value.body["param"] == "structured_outputs"
    if "uniqueItems" in json.dumps(extra):
        assert "not enforced here: " in str(err.value) and "uniqueItems" in str(err.value)
    # the server keeps serving
    r = client.completions.create(model=model, prompt="Hi", max_tokens=2)
    assert r.choices[0].text is not None
