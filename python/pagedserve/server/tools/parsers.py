"""Tool-call parsers: from a model's text to OpenAI tool calls.

Each model family writes calls its own way; a parser reads one format:

  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, once per call
               (Hermes, Qwen 2/2.5/3, and pagedserve's shipped tools template)
  llama3_json  {"name": ..., "parameters": {...}} as the whole reply (Llama 3.1-3.3),
               several joined by ';', optionally after <|python_tag|>
  mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] or [TOOL_CALLS]name[ARGS]{...}

plus the two that read what the grammar forces for tool_choice "required" (a JSON
array of {"name", "arguments"}) and for a named function (the arguments object).

parse(text, final) is called on the whole text so far. While the text grows
(final=False) it may only return what cannot change: content that cannot be
the start of a call marker, names once complete, and arguments as a prefix of
their final raw text (streaming sends the growth). With final=True a call
that is incomplete or whose arguments are not a JSON object turns the whole
reply back into content, as vLLM does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

from pagedserve.server.tools.json_scan import array_items, object_members, skip_ws

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class CallSoFar:
    name: Optional[str] = None  # None until the whole name has arrived
    arguments: str = ""  # the raw JSON text of the arguments so far (a prefix of the final text)
    complete: bool = False


@dataclass
class Parsed:
    content: str = ""
    calls: list[CallSoFar] = field(default_factory=list)


class ToolParser:
    name = ""

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError


def held_back(text: str, marker: str) -> str:
    """`text` without a tail that could still grow into `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return text[:-size]
    return text


def call_from_object(text: str, start: int) -> tuple[CallSoFar, Optional[int]]:
    """The call written as the object at text[start] and the index past it (None while open)."""
    members, end = object_members(text, start)
    call = CallSoFar()
    for m in members:
        if m.key == "name" and m.end is not None:
            call.name = json.loads(m.raw(text))
        elif m.key in ARGUMENT_KEYS:
            raw = m.raw(text)
            if raw.startswith('"'):  # arguments sent as a JSON string holding JSON: only whole
                call.arguments = json.loads(raw) if m.end is not None else ""
            else:
                call.arguments = raw
            call.complete = m.end is not None
    if end is not None and not any(m.key in ARGUMENT_KEYS for m in members):
        call.arguments, call.complete = "{}", True  # a call without arguments
    return call, end


def calls_from_array(text: str, start: int) -> tuple[list[CallSoFar], Optional[int]]:
    items, end = array_items(text, start)
    calls = []
    for item_start, _ in items:
        if text[item_start] != "{":
            raise ValueError("a tool call must be a JSON object")
        calls.append(call_from_object(text, item_start)[0])
    return calls, end


def finished(parsed: Parsed, text: str) -> Parsed:
    """The final reading: every call whole, named, with object arguments, or else all content."""
    for call in parsed.calls:
        try:
            ok = call.complete and isinstance(call.name, str) and isinstance(json.loads(call.arguments), dict)
        except ValueError:
            ok = False
        if not ok:
            return Parsed(content=text)
    return parsed


def _safely(parse_fn, text: str, final: bool) -> Parsed:
    """Runs a format's reader; text that cannot be a call in that format is content."""
    try:
        parsed = parse_fn(text, final)
    except (ValueError, IndexError):
        return Parsed(content=text) if final else Parsed(content="")
    return finished(parsed, text) if final else parsed


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        return _safely(self._read, text, final)

    def _read(self, text: str, final: bool) -> Parsed:
        out = Parsed()
        pos = 0
        while True:
            s = text.find(self.START, pos)
            if s < 0:
                tail = text[pos:]
                out.content += tail if final else held_back(tail, self.START)
                return out
            out.content += text[pos:s]
            body = skip_ws(text, s + len(self.START))
            if body >= len(text):
                out.calls.append(CallSoFar())  # a call has begun
                return out
            if text[body] == "[":
                calls, end = calls_from_array(text, body)
            else:
                call, end = call_from_object(text, body)
                calls = [call]
            out.calls.extend(calls)
            if end is None:
                return out
            close = text.find(self.END, end)
            if close < 0:
                return out  # the closing tag may still come (or never: final keeps the calls)
            pos = close + len(self.END)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        return _safely(self._read, text, final)

    def _read(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        if text.startswith(self.PYTHON_TAG, i):
            i = skip_ws(text, i + len(self.PYTHON_TAG))
        elif self.PYTHON_TAG.startswith(text[i:]) and not final:
            return Parsed()
        if i >= len(text):
            return Parsed() if not final else Parsed(content=text)
        if text[i] != "{":
            return Parsed(content=text)  # a reply, not a call
        out = Parsed()
        while i < len(text):
            call, end = call_from_object(text, i)
            out.calls.append(call)
            if end is None:
                return out
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ";":
                i = skip_ws(text, i + 1)
            elif i < len(text):
                raise ValueError("text after the tool call")
        return out


class MistralParser(ToolParser):
    name = "mistral"
    MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def parse(self, text: str, final: bool) -> Parsed:
        return _safely(self._read, text, final)

    def _read(self, text: str, final: bool) -> Parsed:
        s = text.find(self.MARKER)
        if s < 0:
            return Parsed(content=text if final else held_back(text, self.MARKER))
        out = Parsed(content=text[:s])
        i = skip_ws(text, s + len(self.MARKER))
        if i < len(text) and text[i] == "[":
            out.calls = calls_from_array(text, i)[0]
            return out
        while i < len(text):  # name[ARGS]{...}, repeated after further [TOOL_CALLS] markers
            a = text.find(self.ARGS, i)
            if a < 0:
                out.calls.append(CallSoFar())
                return out
            call = CallSoFar(name=text[i:a].strip())
            body = skip_ws(text, a + len(self.ARGS))
            if body >= len(text):
                out.calls.append(call)
                return out
            obj, end = call_from_object(text, body) if text[body] == "{" else (None, None)
            if obj is None:
                raise ValueError("[ARGS] must be followed by a JSON object")
            call.arguments = text[body:end] if end is not None else text[body:]
            call.complete = end is not None
            out.calls.append(call)
            if end is None:
                return out
            i = skip_ws(text, end)
            if text.startswith(self.MARKER, i):
                i = skip_ws(text, i + len(self.MARKER))
            elif i < len(text):
                raise ValueError("text after the tool call")
        return out


class RequiredParser(ToolParser):
    """tool_choice "required": the grammar makes the reply a JSON array of {"name", "arguments"}."""

    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        def read(text: str, final: bool) -> Parsed:
            i = skip_ws(text, 0)
            return Parsed(calls=calls_from_array(text, i)[0] if i < len(text) else [])

        return _safely(read, text, final)


class NamedParser(ToolParser):
    """tool_choice naming a function: the grammar makes the whole reply that function's arguments."""

    name = "named"

    def __init__(self, function: str):
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        # Kept as a call even when cut short (finish_reason "length"): the caller asked for this function.
        return Parsed(calls=[CallSoFar(self.function, text.lstrip(), final)])


PARSERS = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def parser_for(name: Optional[str], architecture: str, shipped_template: bool) -> ToolParser:
    """The parser named by --tool-call-parser, else the shipped template's (hermes) when that renders the
    tools, else the model family's."""
    if name:
        return PARSERS[name]()
    if shipped_template:
        return HermesParser()
    if architecture.startswith(("Llama", "MllamaFor")):
        return Llama3JsonParser()
    if architecture.startswith(("Mistral", "Mixtral")):
        return MistralParser()
    return HermesParser()
