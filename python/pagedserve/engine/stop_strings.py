"""Stop strings: finding them in generated text, and streaming safely around them.

A stop string may arrive split over several tokens, so while streaming, text
that could still grow into a stop string is held back until it either does
(and is cut) or cannot any more (and is released).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class StopMatch:
    stop: str  # the stop string that matched
    cut: int  # the final output text is text[:cut]


def check_stop(text: str, stop: Sequence[str], include_stop_str_in_output: bool,
               new_text_len: Optional[int] = None) -> Optional[StopMatch]:
    """The stop string that completes first in ``text``, and where to cut.

    "First" is the smallest end position (ties: the longer string), which is
    what a character-by-character stream would see, so the answer does not
    depend on how the text was chunked. With ``new_text_len`` only matches
    that end in the last ``new_text_len`` characters are looked for (the rest
    was checked before), keeping each step's search short.
    """
    best: Optional[tuple[int, int, str]] = None  # (end, start, stop)
    for s in stop:
        start = text.find(s, _search_start(len(text), len(s), new_text_len))
        if start < 0:
            continue
        candidate = (start + len(s), start, s)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    if best is None:
        return None
    end, start, s = best
    return StopMatch(stop=s, cut=end if include_stop_str_in_output else start)


def held_back_length(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    longest = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


@dataclass
class StopDelta:
    text: str  # newly releasable text
    match: Optional[StopMatch]  # set once a stop string completed: the stream is over


class StopStringStream:
    """Feeds detokenized text through the stop-string rules, releasing only safe text."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool):
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.text = ""  # everything fed so far
        self.released = 0  # text[:released] has been handed out
        self.match: Optional[StopMatch] = None

    @property
    def output_text(self) -> str:
        """The text handed out so far (after a match: the final output)."""
        return self.text[:self.released]

    def feed(self, new_text: str) -> StopDelta:
        if self.match is not None:
            raise ValueError(f"the stream already stopped at {self.match.stop!r}")
        self.text += new_text
        self.match = check_stop(self.text, self.stop, self.include_stop_str_in_output,
                                new_text_len=len(new_text))
        if self.match is not None:
            return StopDelta(self._release_until(self.match.cut), self.match)
        return StopDelta(self._release_until(len(self.text) - self._held_back()), None)

    def flush(self) -> str:
        """The held-back text, once generation ended for another reason."""
        if self.match is not None:
            return ""
        return self._release_until(len(self.text))

    def _held_back(self) -> int:
        # A stop string that will be printed anyway needs no holding back.
        if self.include_stop_str_in_output:
            return 0
        return held_back_length(self.text, self.stop)

    def _release_until(self, end: int) -> str:
        end = max(end, self.released)
        released = self.text[self.released:end]
        self.released = end
        return released


def _search_start(text_len: int, stop_len: int, new_text_len: Optional[int]) -> int:
    if new_text_len is None:
        return 0
    return max(0, text_len - new_text_len - stop_len + 1)
