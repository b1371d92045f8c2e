"""One chat choice's text, as message fields: reasoning_content (a reasoning
parser splits off <think>...</think>), then tool_calls (the request's tool plan
reads the rest), then content. The same object serves a stream (feed() gives
each delta's fields) and one response (message() after the final feed)."""

from __future__ import annotations

from typing import Optional

from pagedserve.server.reasoning import ReasoningParser, ReasoningStream
from pagedserve.server.tools.stream import ToolCallStream
from pagedserve.server.tools.tool_choice import ToolPlan

ASSISTANT = "assistant"


class ChatChoice:
    def __init__(self, reasoning: Optional[ReasoningParser], plan: Optional[ToolPlan]):
        self._reasoning = ReasoningStream(reasoning) if reasoning is not None else None
        self._tools = ToolCallStream(plan.parser, plan.max_calls) if plan and plan.parser else None
        self._named = plan is not None and plan.choice == "named"
        self._reasoning_text = ""
        self._content = ""
        self._done = False

    def feed(self, text: str, final: bool) -> dict:
        """The delta fields for `text`, the choice's next piece (final: its last)."""
        self._done = self._done or final
        delta: dict = {}
        content = text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text, final)
            if reasoning:
                delta["reasoning_content"] = reasoning
                self._reasoning_text += reasoning
        if self._tools is not None:
            content, calls = self._tools.feed(content, final)
            if calls:
                delta["tool_calls"] = calls
        if content:
            delta["content"] = content
            self._content += content
        return delta

    def message(self) -> dict:
        if not self._done:  # a choice cut off without its final piece (an abort) is read as it stands
            self.feed("", final=True)
        message = {"role": ASSISTANT, "content": self._content}
        if self._tools is not None:
            message.update(self._tools.message_fields())
        if self._reasoning is not None:
            message["reasoning_content"] = self._reasoning_text or None
        return message

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        """OpenAI's "tool_calls" when the model chose to call (a named function's call ends with "stop")."""
        if reason == "stop" and self._tools is not None and self._tools.called and not self._named:
            return "tool_calls"
        return reason
