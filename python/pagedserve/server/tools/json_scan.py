"""Scanning JSON text that may still be growing (a model's output mid-stream).

Tool-call arguments are streamed as fragments of the model's own text, not
re-serialised: a fragment sent once must stay a prefix of the final
arguments string. So the parsers work on spans of the raw text — where a
value starts and, once it is complete, where it ends — and these functions
find them without needing the text to be finished. json.loads checks the
complete spans.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

WHITESPACE = " \t\n\r"
_CLOSERS = {"{": "}", "[": "]"}


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def value_end(text: str, start: int) -> Optional[int]:
    """The index just past the JSON value starting at text[start], or None if the text ends first.
    Only the value's extent is found (strings, nesting); validity is json.loads' job."""
    if start >= len(text):
        return None
    first = text[start]
    if first == '"':
        return _string_end(text, start)
    if first in _CLOSERS:
        return _container_end(text, start)
    i = start  # a number, true, false or null: ends at a delimiter, which must have arrived
    while i < len(text) and text[i] not in WHITESPACE + ",]}":
        i += 1
    return i if i < len(text) else None


def _string_end(text: str, start: int) -> Optional[int]:
    i = start + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def _container_end(text: str, start: int) -> Optional[int]:
    stack = [_CLOSERS[text[start]]]
    i = start + 1
    while i < len(text):
        c = text[i]
        if c == '"':
            end = _string_end(text, i)
            if end is None:
                return None
            i = end
            continue
        if c in _CLOSERS:
            stack.append(_CLOSERS[c])
        elif c in "]}":
            if c != stack.pop():
                return i + 1  # mismatched: the value is over (json.loads will refuse it)
            if not stack:
                return i + 1
        i += 1
    return None


@dataclass
class Member:
    """One "key": value of a JSON object: the value's span; end is None while it is incomplete."""

    key: str
    start: int
    end: Optional[int]

    def raw(self, text: str) -> str:
        return text[self.start:self.end] if self.end is not None else text[self.start:]


def object_members(text: str, start: int) -> tuple[list[Member], Optional[int]]:
    """The members of the object opening at text[start] ('{') seen so far, and the index past its
    closing brace (None while it is open). A member appears once its key and the first character of
    its value have arrived. Raises ValueError on text that cannot be a JSON object."""
    if text[start] != "{":
        raise ValueError("not a JSON object")
    members: list[Member] = []
    i = skip_ws(text, start + 1)
    while i < len(text):
        if text[i] == "}":
            return members, i + 1
        if text[i] == ",":
            i = skip_ws(text, i + 1)
            continue
        if text[i] != '"':
            raise ValueError(f"unexpected {text[i]!r} in a JSON object")
        key_end = _string_end(text, i)
        if key_end is None:
            return members, None
        key = json.loads(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text):
            return members, None
        if text[i] != ":":
            raise ValueError(f"expected ':' after the key {key!r}")
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return members, None
        end = value_end(text, i)
        members.append(Member(key, i, end))
        if end is None:
            return members, None
        i = skip_ws(text, end)
    return members, None


def array_items(text: str, start: int) -> tuple[list[tuple[int, Optional[int]]], Optional[int]]:
    """The (start, end) spans of the items of the array opening at text[start] ('[') seen so far (end None
    while the last is incomplete), and the index past the closing bracket (None while it is open)."""
    if text[start] != "[":
        raise ValueError("not a JSON array")
    items: list[tuple[int, Optional[int]]] = []
    i = skip_ws(text, start + 1)
    while i < len(text):
        if text[i] == "]":
            return items, i + 1
        if text[i] == ",":
            i = skip_ws(text, i + 1)
            continue
        end = value_end(text, i)
        items.append((i, end))
        if end is None:
            return items, None
        i = skip_ws(text, end)
    return items, None
