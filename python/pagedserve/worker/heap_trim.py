"""Giving freed CPU heap back to the OS after large steps.

A prefill of a big batch allocates tens of MiB of activations. glibc serves
such blocks from mmap at first, but its mmap threshold rises to the size of
each freed mmapped block (up to 32 MiB), so after the first steps they come
from the heap, and freed heap memory stays in the process's RSS. Once the
steps have shrunk (the batch is decoding, or has finished), malloc_trim(0)
returns those free pages. It costs a walk over the heap, so it runs only when
a step is much smaller than the largest since the last trim, never every step.

Steps of one size fragment the heap too: a decode step of 64 sequences frees
its 12 MiB of logits, small allocations then split that hole, and the next
step's logits come from fresh heap, so resident free heap grows by about 12 MiB
every few steps (SmolLM2-135M, batch 64, 64 output tokens: ~50 MiB by the end,
130 MiB of free heap). A CPU engine therefore pins glibc's mmap threshold at
MMAP_THRESHOLD_BYTES (process-wide; glibc otherwise raises it up to 32 MiB as
mmapped blocks are freed): blocks that large are mapped and unmapped on their
own and never fragment the heap, at the cost of faulting their pages in each
time (about 1 ms per 12 MiB, against a batch-64 decode step of 60-150 ms).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Callable, Optional

# A step this many tokens or more leaves enough free heap to be worth a trim
# (SmolLM2-135M: ~1.5 MiB of activations per token in flight).
TRIM_AFTER_TOKENS = 256
SHRINK_FACTOR = 4  # trim once a step has a quarter of the tokens of the largest
MMAP_THRESHOLD_BYTES = 4 << 20  # below SmolLM2's batch-64 logits (12 MiB), above its decode activations
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None  # else not glibc


def _glibc_malloc_trim() -> Optional[Callable[[int], int]]:
    libc = _glibc()
    if libc is None:  # not glibc (musl, macOS): nothing to trim
        return None
    libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)  # see the module docstring
    trim = libc.malloc_trim
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class HeapTrimmer:
    def __init__(self, enabled: bool = True):
        """enabled: a CPU engine's (also pins the mmap threshold, see the module docstring)."""
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
