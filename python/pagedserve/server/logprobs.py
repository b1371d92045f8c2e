"""Logprobs in the two shapes the OpenAI API uses: the legacy completions
shape (parallel lists; with echo, the prompt's tokens first) and the chat shape
(one object per token); and vLLM's prompt_logprobs.

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


def prompt_completion_logprobs(prompt_token_ids: list[int], entries: list[Optional[dict]], first_token: str,
                               top_n: int) -> dict:
    """The completions shape for an echoed prompt (RequestOutput.prompt_logprobs: None for the first token,
    which has no logprob; `first_token` is its text), text offsets from 0."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for token_id, entry in zip(prompt_token_ids, entries, strict=True):
        if entry is None:
            text, value, top = first_token, None, None
        else:
            text, value = _text(entry[token_id]), entry[token_id].logprob
            top = {_text(lp): lp.logprob for _, lp in _top(entry, top_n)} if top_n else None
        out["tokens"].append(text)
        out["token_logprobs"].append(value)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def vllm_prompt_logprobs(entries: Optional[list[Optional[dict]]]) -> Optional[list[Optional[dict]]]:
    """vLLM's "prompt_logprobs" of a completions choice: per prompt token None (the first) or
    {token_id: {"logprob", "rank", "decoded_token"}}."""
    if entries is None:
        return None
    return [None if entry is None else
            {token_id: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for token_id, lp in entry.items()} for entry in entries]


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
