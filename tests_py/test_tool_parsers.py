"""Tool-call and reasoning parsers on fixed texts: what each format yields, and that streaming
any split of a text gives deltas whose concatenation is the one-shot message."""

import json
import random

import pytest

from pagedserve.server.chat_choice import ChatChoice
from pagedserve.server.reasoning import REASONING_PARSERS
from pagedserve.server.tools.json_scan import object_members, value_end
from pagedserve.server.tools.parsers import (HermesParser, Llama3JsonParser, MistralParser, NamedParser,
                                             RequiredParser, held_back)
from pagedserve.server.tools.tool_choice import ToolPlan

WEATHER = {"city": "Paris", "days": [1, 2], "note": "a \"quoted\" } brace"}


def _plan(parser, choice="auto"):
    return ToolPlan(tools=[], choice=choice, parser=parser, grammar=None, max_calls=None)


def _one_shot(text, parser=None, reasoning=None, choice="auto"):
    choice_obj = ChatChoice(REASONING_PARSERS.get(reasoning), _plan(parser, choice) if parser else None)
    choice_obj.feed(text, final=True)
    return choice_obj.message(), choice_obj.finish_reason("stop")


def _streamed(text, parser=None, reasoning=None, seed=0, choice="auto"):
    """Feeds `text` in random pieces; returns the merged deltas as a message."""
    rng = random.Random(seed)
    choice_obj = ChatChoice(REASONING_PARSERS.get(reasoning), _plan(parser, choice) if parser else None)
    pieces, i = [], 0
    while i < len(text):
        step = rng.randint(1, 6)
        pieces.append(text[i:i + step])
        i += step
    merged = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for k, piece in enumerate(pieces):
        delta = choice_obj.feed(piece, final=k == len(pieces) - 1)
        merged["content"] += delta.get("content", "")
        merged["reasoning_content"] += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            slot = merged["tool_calls"].setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in call:
                assert slot["id"] is None, "the id is sent once"
                slot["id"], slot["name"] = call["id"], call["function"]["name"]
            else:
                assert slot["id"] is not None, "arguments come after the call's id and name"
            slot["arguments"] += call["function"].get("arguments", "")
    return merged


def _check_stream_matches(text, parser=None, reasoning=None, choice="auto"):
    message, _ = _one_shot(text, parser, reasoning, choice)
    for seed in range(5):
        merged = _streamed(text, parser, reasoning, seed, choice)
        assert merged["content"] == (message["content"] or "")
        assert merged["reasoning_content"] == (message.get("reasoning_content") or "")
        calls = message.get("tool_calls") or []
        assert [(c["name"], c["arguments"]) for c in merged["tool_calls"].values()] == \
               [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    return message


def test_json_scan_spans():
    text = '{"a": "x}\\"y", "b": [1, {"c": null}], "d": 12}'
    assert value_end(text, 0) == len(text)
    members, end = object_members(text, 0)
    assert [m.key for m in members] == ["a", "b", "d"] and end == len(text)
    assert [m.raw(text) for m in members] == ['"x}\\"y"', '[1, {"c": null}]', "12"]
    members, end = object_members(text[:24], 0)
    assert end is None and members[-1].key == "b" and members[-1].end is None
    assert value_end('{"a": 1', 0) is None and value_end("12", 0) is None


def test_held_back():
    assert held_back("Hello <tool", "<tool_call>") == "Hello "
    assert held_back("Hello <b>", "<tool_call>") == "Hello <b>"


def test_hermes_calls_and_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) +
            '}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    message, reason = _one_shot(text, HermesParser())
    assert message["content"] == "Let me check."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == WEATHER
    assert reason == "tool_calls"
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"])
    _check_stream_matches(text, HermesParser())


def test_hermes_array_body_and_plain_text():
    text = '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": 2}}]</tool_call>'
    message, _ = _one_shot(text, HermesParser())
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["a", "b"] and message["content"] is None
    plain = "No tools needed: 3 < 4 and <b>bold</b>."
    message, reason = _one_shot(plain, HermesParser())
    assert message == {"role": "assistant", "content": plain} and reason == "stop"
    _check_stream_matches(plain, HermesParser())


def test_hermes_broken_call_is_content():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    message, reason = _one_shot(text, HermesParser())
    assert message["content"] == text and "tool_calls" not in message and reason == "stop"
    text = '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>'  # arguments must be an object
    assert _one_shot(text, HermesParser())[0]["content"] == text


def test_llama3_json():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "x", "parameters": {}}'
    message = _check_stream_matches(text, Llama3JsonParser())
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("get_weather", {"city": "Oslo"}), ("x", {})]
    reply = "The weather is fine {maybe}."
    assert _one_shot(reply, Llama3JsonParser())[0]["content"] == reply
    _check_stream_matches(reply, Llama3JsonParser())


def test_mistral_both_formats():
    text = 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    message = _check_stream_matches(text, MistralParser())
    assert message["content"] == "Sure." and message["tool_calls"][0]["function"]["name"] == "get_weather"
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{}'
    message = _check_stream_matches(text, MistralParser())
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}


def test_required_and_named():
    text = ' [{"name": "get_weather", "arguments": {"city": "Lima"}}, {"name": "get_time", "arguments": {}}]'
    message = _check_stream_matches(text, RequiredParser(), choice="required")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    text = '{"city": "Lima", "days": [3]}'
    message = _check_stream_matches(text, NamedParser("get_weather"), choice="named")
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": text}
    assert _one_shot(text, NamedParser("get_weather"), choice="named")[1] == "stop"  # as OpenAI ends a named call


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_reasoning(name):
    text = "<think>\nAdd 2 and 2.\n</think>\n\nThe answer is 4."
    message = _check_stream_matches(text, reasoning=name)
    assert message["reasoning_content"] == "\nAdd 2 and 2.\n" and message["content"] == "The answer is 4."
    # Without tags: Qwen3 did not think (all content); R1's reasoning was opened by the prompt.
    message = _check_stream_matches("Only an answer.", reasoning=name)
    if name == "qwen3":
        assert message["content"] == "Only an answer." and message["reasoning_content"] is None
    else:
        assert message["reasoning_content"] == "Only an answer." and message["content"] == ""


def test_reasoning_then_tool_call():
    text = '<think>Need weather.</think><tool_call>{"name": "w", "arguments": {"c": 1}}</tool_call>'
    message = _check_stream_matches(text, HermesParser(), reasoning="qwen3")
    assert message["reasoning_content"] == "Need weather." and message["content"] is None
    assert message["tool_calls"][0]["function"]["name"] == "w"
