"""Giving freed CPU heap back to the OS after large steps.

A prefill of a big batch allocates tens of MiB of activations. glibc serves
such blocks from mmap at first, but its mmap threshold rises to the size of
each freed mmapped block (up to 32 MiB), so after the first steps they come
from the heap, and freed heap memory stays in the process's RSS. Once the
steps have shrunk (the batch is decoding, or has finished), malloc_trim(0)
returns those free pages. It costs a walk over the heap, so it runs only when
a step is much smaller than the largest since the last trim, never every step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Callable, Optional

# A step this many tokens or more leaves enough free heap to be worth a trim
# (SmolLM2-135M: ~1.5 MiB of activations per token in flight).
TRIM_AFTER_TOKENS = 256
SHRINK_FACTOR = 4  # trim once a step has a quarter of the tokens of the largest


def _glibc_malloc_trim() -> Optional[Callable[[int], int]]:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class HeapTrimmer:
    def __init__(self, enabled: bool = True):
        self._trim = _glibc_malloc_trim() if enabled else None
        self._largest = 0
        self.trims = 0

    def trim(self) -> None:
        """Trims now (after loading: the float32 copies packing replaced are free heap)."""
        if self._trim is not None:
            self._trim(0)
            self.trims += 1

    def note_step(self, num_tokens: int) -> None:
        """Called before each step with its token count; trims when it shrank a lot."""
        if self._trim is None:
            return
        if self._largest >= TRIM_AFTER_TOKENS and num_tokens * SHRINK_FACTOR <= self._largest:
            self.trim()
            self._largest = num_tokens
        else:
            self._largest = max(self._largest, num_tokens)
