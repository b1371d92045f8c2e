"""ParallelContext: where this process sits in the tensor-parallel group, and the collectives layers call.

Passed explicitly into model construction (no global state beyond torch.distributed's own): the
parallel layers (models/parallel_layers.py) read `rank` and `world_size` to size and load their
shard, and call `all_reduce` / `gather_to_driver` in their forward. With world_size 1 every
collective is the identity and the models build their plain layers.

Two process groups: `group` carries the model's tensors (NCCL on CUDA, gloo on CPU) with a timeout
that bounds how long a rank waits for a hung peer inside a step; `control` (gloo, on the host)
carries the driver's step messages, with no practical timeout, since a rank waits there for as long
as the engine sits idle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

DRIVER_RANK = 0


@dataclass(frozen=True)
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # the device process group (None: a single rank)
    control: Any = None  # the host (gloo) group of the step messages

    @property
    def is_driver(self) -> bool:
        return self.rank == DRIVER_RANK

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks in place (one collective); returns x."""
        if self.is_parallel:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_to_driver(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """[R, C] on every rank -> [R, world * C] (rank-major columns) on the driver; None elsewhere."""
        if not self.is_parallel:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_driver else None
        dist.gather(x, parts, dst=DRIVER_RANK, group=self.group)
        return torch.cat(parts, dim=1) if parts is not None else None

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's value (a GPU's KV-cache budget: the block count must agree)."""
        return self._agree(value, dist.ReduceOp.MIN, device)

    def max_int(self, value: int, device: torch.device) -> int:
        """The largest of every rank's value (bytes per KV block, where ranks hold unequal KV heads)."""
        return self._agree(value, dist.ReduceOp.MAX, device)

    def _agree(self, value: int, op, device: torch.device) -> int:
        """On the control group: ranks reach it at startup, as far apart as their weight loading."""
        if not self.is_parallel:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=op, group=self.control)
        return int(t.item())

    def split(self, size: int) -> tuple[int, int]:
        """(start, length) of this rank's share of `size` items: equal shares, the first size % N ranks
        one more (9 heads over 2 ranks: 5 and 4)."""
        return balanced_split(size, self.world_size, self.rank)


def balanced_split(size: int, parts: int, index: int) -> tuple[int, int]:
    base, extra = divmod(size, parts)
    return index * base + min(index, extra), base + (index < extra)


SINGLE = ParallelContext()
