"""One choice's tool calls as OpenAI streams them, and as one message.

A ToolCallStream reads the choice's whole text so far with its parser after
every delta and sends what grew: content, then for each call its id, type and
name once, then its arguments in fragments. Concatenated, the fragments are
the arguments string the non-streamed message carries.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Optional

from pagedserve.server.tools.parsers import Parsed, ToolParser


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class _Sent:
    id: str
    arguments: int = 0  # characters of the arguments already sent


@dataclass
class ToolCallStream:
    parser: ToolParser
    max_calls: Optional[int] = None  # parallel_tool_calls=false: 1
    text: str = ""
    _content_sent: int = 0
    _calls: list[_Sent] = field(default_factory=list)
    _final: Optional[Parsed] = None

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict]]:
        """The content delta and the tool-call deltas after `delta` (final: the text is complete)."""
        self.text += delta
        parsed = self.parser.parse(self.text, final)
        calls = parsed.calls[:self.max_calls] if self.max_calls is not None else parsed.calls
        if final:
            self._final = Parsed(parsed.content, calls)
        # Whitespace around calls is not content; held back until text follows it.
        content = parsed.content.rstrip() if calls or not final else parsed.content
        content_delta = content[self._content_sent:] if len(content) > self._content_sent else ""
        self._content_sent += len(content_delta)
        return content_delta, self._call_deltas(calls)

    def _call_deltas(self, calls) -> list[dict]:
        deltas = []
        for index, call in enumerate(calls):
            if call.name is None:
                break  # later calls wait for this one's name
            if index == len(self._calls):
                self._calls.append(_Sent(new_call_id()))
                deltas.append({"index": index, "id": self._calls[index].id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            sent = self._calls[index]
            if len(call.arguments) > sent.arguments:
                fragment = call.arguments[sent.arguments:]
                sent.arguments = len(call.arguments)
                if deltas and deltas[-1]["index"] == index:
                    deltas[-1]["function"]["arguments"] += fragment
                else:
                    deltas.append({"index": index, "function": {"arguments": fragment}})
        return deltas

    @property
    def called(self) -> bool:
        return bool(self._final.calls if self._final is not None else self._calls)

    def message_fields(self) -> dict:
        """content and tool_calls of the finished message (feed(..., final=True) first)."""
        parsed = self._final
        if not parsed.calls:
            return {"content": parsed.content}
        ids = [s.id for s in self._calls] + [new_call_id() for _ in parsed.calls[len(self._calls):]]
        return {"content": parsed.content.strip() or None,
                "tool_calls": [{"id": ids[i], "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments}}
                               for i, c in enumerate(parsed.calls)]}
