"""Incremental detokenization: the text each new token adds, ready to stream.

Decoding one token alone is wrong in two ways: byte-level tokens may carry
only part of a UTF-8 character, and some decoders (SentencePiece's leading
space, say) render a token differently at the start of a text than after
other tokens. So each step decodes a short window that starts a few tokens
back (``prefix_offset``) and keeps only what lies beyond the text already
handed out (up to ``read_offset``). A window whose text ends in U+FFFD is an
unfinished character: it is held back until a later token completes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # a type only: importing transformers takes seconds
    from transformers import PreTrainedTokenizerBase

from pagedserve.engine.stop_strings import StopDelta, StopMatch, StopStringStream, check_stop

__all__ = ["IncrementalDetokenizer", "check_stop", "StopMatch", "StopStringStream", "StopDelta"]

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded ahead of the first output token: enough context for
# decoders whose rendering of a token depends on its left neighbours.
PROMPT_CONTEXT_TOKENS = 5

# How far back the first window may reach to start on a whole character.
MAX_PROMPT_CONTEXT_TOKENS = 64


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # A fast tokenizer's Rust decoder gives the same text (without the
        # clean-up pass) for half the cost of the Python wrapper: this runs for
        # every sequence on every step.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self.token_ids = list(prompt_token_ids)
        self.read_offset = len(self.token_ids)
        self.prefix_offset, self._prefix_text = self._first_window()
        self.output_text = ""  # every piece step() and flush() returned, joined

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Appends tokens; returns the text they finalized (possibly empty)."""
        self.token_ids.extend(new_token_ids)
        window_text = self._decode(self.prefix_offset, len(self.token_ids))
        if window_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._advance(window_text)

    def flush(self) -> str:
        """At the end of the stream: releases held text, unfinished characters included."""
        return self._advance(self._decode(self.prefix_offset, len(self.token_ids)))

    def _first_window(self) -> tuple[int, str]:
        """A prompt tail of a few tokens that starts on a character boundary.

        A window that starts inside a character renders that character as
        U+FFFD; byte-fallback decoders then garble the whole run of byte
        tokens around it, so the window reaches back to where the run begins.
        """
        start = max(self.read_offset - PROMPT_CONTEXT_TOKENS, 0)
        lowest = max(self.read_offset - MAX_PROMPT_CONTEXT_TOKENS, 0)
        text = self._decode(start, self.read_offset)
        while text.startswith(REPLACEMENT_CHAR) and start > lowest:
            start -= 1
            text = self._decode(start, self.read_offset)
        return start, text

    def _advance(self, window_text: str) -> str:
        # The window only grew at its end, so its text extends the prefix's;
        # a token that renders as nothing (a skipped special token) adds nothing.
        if len(window_text) <= len(self._prefix_text):
            return ""
        new_text = window_text[len(self._prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self._prefix_text = self._decode(self.prefix_offset, self.read_offset)
        self.output_text += new_text
        return new_text

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        ids = self.token_ids[start:end]
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)
