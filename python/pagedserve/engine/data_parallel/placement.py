"""Where each replica runs: its share of the CPU threads, or its own GPUs.

On CPU the N replicas split the cores (each gets total // N threads for its ops and torch), so N
replicas never oversubscribe the machine. On CUDA replica i sees only its own GPUs through
CUDA_VISIBLE_DEVICES, tensor_parallel_size of them (GPUs i*tp .. i*tp+tp-1 of those the server
sees): its engine, and the tensor-parallel ranks it starts, address them as cuda:0 .. cuda:tp-1, so
--data-parallel-size 2 --tensor-parallel-size 2 is 4 ranks on 4 GPUs with nothing here knowing TP.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from pagedserve.engine_config import EngineConfig


@dataclass(frozen=True)
class ReplicaPlacement:
    index: int
    device_type: str  # "cpu" or "cuda"
    num_threads: int  # CPU threads of the replica's ops and torch
    cuda_visible_devices: Optional[str] = None  # the replica's GPUs, as CUDA_VISIBLE_DEVICES lists them

    def describe(self) -> str:
        if self.device_type == "cuda":
            return f"cuda (GPU {self.cuda_visible_devices})"
        return f"cpu ({self.num_threads} thread{'s' if self.num_threads != 1 else ''})"


def place_replicas(config: EngineConfig) -> list[ReplicaPlacement]:
    """One placement per replica; ValueError when the GPUs are too few for data x tensor parallel."""
    from pagedserve.models.model_config import resolve_device

    n, tp = config.data_parallel_size, config.tensor_parallel_size
    threads = max(1, available_cpus() // n)
    device = resolve_device(config.device)
    if device.type != "cuda":
        return [ReplicaPlacement(i, "cpu", threads) for i in range(n)]
    gpus = visible_gpus()
    if len(gpus) < n * tp:
        raise ValueError(f"--data-parallel-size {n} x --tensor-parallel-size {tp} needs {n * tp} GPUs, "
                         f"{len(gpus)} visible; lower one of them (or set CUDA_VISIBLE_DEVICES)")
    return [ReplicaPlacement(i, "cuda", threads, ",".join(gpus[i * tp:(i + 1) * tp])) for i in range(n)]


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a container's cpuset, taskset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def visible_gpus() -> list[str]:
    """The GPUs this process sees, as CUDA_VISIBLE_DEVICES entries."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]
