"""Logprobs in the two shapes the OpenAI API uses: the legacy completions
shape (parallel lists) and the chat shape (one object per token).

The engine gives, per generated token, {token_id: Logprob(logprob, rank,
decoded_token)} holding the sampled token and the top-N alternatives.
"""

from __future__ import annotations

from typing import Optional


def _text(lp) -> str:
    return lp.decoded_token if lp.decoded_token is not None else ""


def _top(entry: dict, n: int) -> list[tuple[int, object]]:
    """The n most likely tokens of one position, most likely first."""
    return sorted(entry.items(), key=lambda item: -item[1].logprob)[:n]


class CompletionLogprobs:
    """Accumulates the completions shape for one choice across stream deltas."""

    def __init__(self, top_n: int, text_offset: int = 0):
        self.top_n = top_n
        self._offset = text_offset

    def delta(self, token_ids: list[int], entries: Optional[list[dict]]) -> Optional[dict]:
        if entries is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(token_ids, entries, strict=True):
            sampled = entry[token_id]
            out["tokens"].append(_text(sampled))
            out["token_logprobs"].append(sampled.logprob)
            out["top_logprobs"].append({_text(lp): lp.logprob for _, lp in _top(entry, self.top_n)}
                                       if self.top_n else None)
            out["text_offset"].append(self._offset)
            self._offset += len(_text(sampled))
        return out


def merge_completion_logprobs(parts: list[dict]) -> Optional[dict]:
    if not parts:
        return None
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in merged:
            merged[key].extend(part[key])
    return merged


def chat_logprobs(token_ids: list[int], entries: Optional[list[dict]], top_n: int) -> Optional[list[dict]]:
    """The chat shape's "content" list for some tokens."""
    if entries is None:
        return None
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        sampled = entry[token_id]
        content.append({
            "token": _text(sampled), "logprob": sampled.logprob, "bytes": list(_text(sampled).encode("utf-8")),
            "top_logprobs": [{"token": _text(lp), "logprob": lp.logprob, "bytes": list(_text(lp).encode("utf-8"))}
                             for _, lp in _top(entry, top_n)],
        })
    return content
