"""Reasoning parsers: a thinking model's <think>...</think> goes to reasoning_content.

  qwen3        the reply opens with <think> when the model thinks; without it all is content
               (e.g. chat_template_kwargs {"enable_thinking": false})
  deepseek_r1  the template opens <think> in the prompt, so the reply starts inside the
               reasoning; without </think> all of it is reasoning

split(text, final) reads the whole reply so far; while it grows it holds back a
tail that could still become a tag, so what it returns only grows.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.server.tools.parsers import held_back

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_inside: bool  # the prompt already opened the reasoning

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the reply so far."""
        body = text.lstrip()
        if body.startswith(START):
            body = body[len(START):]
        elif not final and START.startswith(body):
            return "", ""  # may still open
        elif not self.starts_inside:
            return "", text
        end = body.find(END)
        if end < 0:
            return (body, "") if final else (held_back(body, END), "")
        return body[:end], body[end + len(END):].lstrip("\n")


REASONING_PARSERS = {"qwen3": ReasoningParser("qwen3", starts_inside=False),
                     "deepseek_r1": ReasoningParser("deepseek_r1", starts_inside=True)}


@dataclass
class ReasoningStream:
    """One choice's reasoning and content deltas as the reply grows."""

    parser: ReasoningParser
    text: str = ""
    _sent: tuple[int, int] = (0, 0)

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        self.text += delta
        reasoning, content = self.parser.split(self.text, final)
        r_sent, c_sent = self._sent
        self._sent = (max(r_sent, len(reasoning)), max(c_sent, len(content)))
        return reasoning[r_sent:], content[c_sent:]
