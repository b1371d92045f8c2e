"""The structured-output token mask as the sampler takes it (filled by pagedserve.engine.grammar).

Both grammar backends (xgrammar, and llguidance where xgrammar cannot compile) write the same layout, an
int32 [rows, ceil(vocab / 32)] bitmask with token t allowed when bit t % 32 of word t // 32 is set, so
one kernel (xgrammar's) applies either's rows."""

from __future__ import annotations

import torch


class GrammarMask:
    """A step's host bitmask and the logits rows it applies to (the sampler's `grammar` argument)."""

    def __init__(self, bitmask: torch.Tensor, rows: list[int]):
        self.bitmask = bitmask  # [>= R, ceil(V / 32)] int32 on the host (pinned when the sampler is on CUDA)
        self.rows = rows  # the logits rows constrained; the others are left alone


def apply_mask(logits: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
    """A float32 copy of `logits` ([R, V], on their device) with the grammar's forbidden tokens at -inf."""
    import xgrammar as xgr

    out = logits.to(torch.float32, copy=True)
    bitmask = mask.bitmask[:out.shape[0]]
    rows = mask.rows
    if out.device.type != "cpu":
        bitmask = bitmask.to(out.device, non_blocking=True)
        # xgrammar copies a list of rows from pageable memory, which may wait for the device (the step's
        # forward) on the host; every row constrained needs no list, the others travel pinned.
        rows = None if rows == list(range(out.shape[0])) else torch.tensor(rows, dtype=torch.int32).pin_memory().to(
            out.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=out.shape[1], indices=rows)
    return out
