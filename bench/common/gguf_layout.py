"""Loading GGUF blocks in the file's layout, for before/after figures of the interleaved one.

Loading interleaves Q4_0 / Q4_1 / Q8_0 blocks on the CPU (pagedserve.models.gguf_linear.Segment.interleaved,
cpp/ops/gguf_interleaved.h); engines built inside ``file_layout()`` keep the blocks as the file has them.
"""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def file_layout():
    from pagedserve.models.gguf_linear import Segment

    interleaved = Segment.interleaved
    Segment.interleaved = lambda segment: segment
    try:
        yield
    finally:
        Segment.interleaved = interleaved
