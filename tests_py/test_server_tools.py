"""Tool calling and reasoning through the real server (default model, CPU) and the official `openai`
client: tool_choice named, required and auto, streamed and not, n = 2, a multi-turn conversation with
the calls and results in the history, parallel_tool_calls, the shipped tools template, the 400s, and
reasoning_content. Arguments are checked with json and jsonschema against each tool's parameters."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from server_process import ServerProcess

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a timezone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
GREEDY = {"temperature": 0.0, "max_tokens": 80}


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-num-seqs", "8", "--reasoning-parser", "qwen3") as s:
        yield s


def _check_call(name, arguments):
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _streamed(stream):
    """(content, {index: (id, name, arguments)}, finish_reason) from a chat stream, checking that each
    call's id and name come once, before its argument fragments."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    assert call.index not in calls
                    calls[call.index] = [call.id, call.function.name, call.function.arguments or ""]
                else:
                    assert call.function.name is None
                    calls[call.index][2] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_named_function(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, **GREEDY,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    _check_call(call.function.name, call.function.arguments)


def test_named_function_streaming_matches(client, model):
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, tool_choice={"type": "function",
                                                                      "function": {"name": "get_time"}}, **GREEDY)
    one = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    content, calls, finish = _streamed(client.chat.completions.create(stream=True, **kwargs))
    assert finish == "stop" and content == "" and list(calls) == [0]
    _, name, arguments = calls[0]
    assert (name, arguments) == (one.function.name, one.function.arguments)
    _check_call(name, arguments)


def test_required_n2(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required", n=2,
                                       temperature=0.9, seed=5, max_tokens=120)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            _check_call(call.function.name, call.function.arguments)


def test_required_streaming_one_call(client, model):
    stream = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, stream=True, **GREEDY)
    content, calls, finish = _streamed(stream)
    assert finish == "tool_calls" and content == "" and len(calls) == 1
    _check_call(calls[0][1], calls[0][2])


def test_auto_reads_hermes_calls(client, model):
    # The regex makes the model write a call in the shipped template's format; the server must read it.
    regex = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,9}", ' \
            r'"unit": "celsius"\}\}\n</tool_call>'
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="auto", **GREEDY,
                  extra_body={"structured_outputs": {"regex": regex}})
    r = client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    _check_call(call.function.name, call.function.arguments)
    content, calls, finish = _streamed(client.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls" and content == ""
    assert calls[0][1:] == [call.function.name, call.function.arguments]


def test_auto_any_reply_is_valid(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, n=2, temperature=1.0, seed=1,
                                       max_tokens=120)
    for choice in r.choices:
        for call in choice.message.tool_calls or []:
            _check_call(call.function.name, call.function.arguments)
        assert choice.message.tool_calls or choice.message.content


def test_multi_turn_conversation(server, client, model):
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           **GREEDY).choices[0].message
    history = ASK + [first.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"} for call in first.tool_calls]
    r = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none", **GREEDY)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    # The calls and the result reach the prompt: the shipped template rendered them.
    tokens = server.post("/tokenize", json={"model": model, "messages": history, "tools": TOOLS}).json()
    text = "".join(tokens["token_strs"]).replace("Ġ", " ").replace("Ċ", "\n")
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in text
    assert '<tool_call>\n{"name": "' + first.tool_calls[0].function.name in text
    assert '"name": "get_time"' in text  # the tools are listed


@pytest.mark.parametrize("extra, field", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_fields_are_400(client, model, extra, field):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, extra_body=extra)
    assert err.value.body["param"] == field


def test_bad_history_is_400(client, model):
    history = ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]
    with pytest.raises(openai.BadRequestError, match="not valid JSON"):
        client.chat.completions.create(model=model, messages=history, max_tokens=4)


def test_reasoning_content(client, model):
    regex = r"<think>[a-z ]{4,30}</think>\n[A-Z][a-z ]{3,30}\."
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Think, then answer."}], **GREEDY,
                  extra_body={"structured_outputs": {"regex": regex}})
    message = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in message.content
    assert message.content[0].isupper() and message.content.endswith(".")
    streamed_reasoning, streamed_content = "", ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            streamed_reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            streamed_content += choice.delta.content or ""
    assert (streamed_reasoning, streamed_content) == (reasoning, message.content)
