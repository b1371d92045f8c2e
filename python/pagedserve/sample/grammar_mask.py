"""The structured-output token mask as the sampler takes it (filled by pagedserve.engine.grammar).

Both grammar backends (xgrammar, and llguidance where xgrammar cannot compile) write the same layout, an
int32 [rows, ceil(vocab / 32)] bitmask with token t allowed when bit t % 32 of word t // 32 is set, so
one kernel applies either's rows: the sampler's own (ops.sample_tokens reads the mask in its pass over the
logits) where the rows sample plainly, xgrammar's (apply_mask, on a float32 copy) before the other
sampling parameters."""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

import torch


class GrammarMask:
    """A step's host bitmask and the logits rows it applies to (the sampler's `grammar` argument)."""

    def __init__(self, bitmask: torch.Tensor, rows: list[int], ready: Optional[Callable[[torch.device], None]] = None):
        self.bitmask = bitmask  # [>= R, ceil(V / 32)] int32 on the host (pinned when the sampler is on CUDA)
        self.rows = rows  # the logits rows constrained; the others are left alone
        # Where the constrained rows are still filling (the grammar thread's job): makes a device wait until
        # they are in before it reads them (a CUDA stream waits on the device, the CPU here)
        self.ready = ready

    def allowed(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """The mask of logits rows [0, num_rows) as ops.sample_tokens takes it, on `device`: the
        constrained rows' words, every token allowed in the others (written into the host buffer,
        whose other rows hold earlier steps' masks)."""
        bitmask = self.bitmask[:num_rows]
        if len(self.rows) < num_rows:
            constrained = set(self.rows)
            for row in range(num_rows):
                if row not in constrained:
                    bitmask[row] = -1
        return self.on_device(bitmask, device)

    def on_device(self, bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`bitmask` (rows of self.bitmask) where `device` reads it once the rows are in (see `ready`)."""
        if self.ready is not None:
            self.ready(device)
        return bitmask if device.type == "cpu" else bitmask.to(device, non_blocking=True)


class MaskSource(Protocol):
    """A step's grammars, asked for masks only as needed (engine.grammar_step.GrammarStep): the sampler's
    `grammar` argument where it may check its draws before masking."""

    check_first: bool  # whether checking draws before masking is expected to pay
    threaded: bool  # whether a plain draw's tokens go to the thread that fills the masks (threaded_mask, drawn)

    def threaded_mask(self) -> Optional["GrammarMask"]:
        """A threaded source's mask for a plain draw that is handed to drawn() next (its rows may still be
        filling: `ready`)."""

    def drawn(self, pending) -> None:
        """A threaded source's plain draw was queued (its PendingSamples): its tokens may be taken as they
        arrive."""

    def mask(self, rows: Optional[Sequence[int]] = None) -> Optional[GrammarMask]:
        """The mask of every constrained row, or of those among `rows`; None when none needs one."""

    def refused(self, token_ids: Sequence[int]) -> list[int]:
        """The rows whose drawn token (token_ids[row]) their grammar would not accept."""


def apply_mask(logits: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
    """A float32 copy of `logits` ([R, V], on their device) with the grammar's forbidden tokens at -inf."""
    import xgrammar as xgr

    out = logits.to(torch.float32, copy=True)
    bitmask = mask.on_device(mask.bitmask[:out.shape[0]], out.device)
    rows = mask.rows
    if out.device.type != "cpu":
        # xgrammar copies a list of rows from pageable memory, which may wait for the device (the step's
        # forward) on the host; every row constrained needs no list, the others travel pinned.
        rows = None if rows == list(range(out.shape[0])) else torch.tensor(rows, dtype=torch.int32).pin_memory().to(
            out.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=out.shape[1], indices=rows)
    return out
