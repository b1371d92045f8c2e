"""Starting a tensor-parallel group and the driver's worker over it.

Two ways in, one group afterwards:
  spawned   (one node) the engine's process is rank 0; it starts ranks 1..N-1 with torch.multiprocessing
            (start method spawn), which meet it at a TCPStore it opened on 127.0.0.1.
  torchrun  (one or several nodes) every rank was started by torchrun; rank 0 runs the engine (the CLI,
            the server or a script) and finds the group in the environment (env:// rendezvous:
            MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), the others run torchrun_entry's rank loop.
Then, on every rank alike: the device group (NCCL on CUDA, gloo on CPU) and the control group (gloo);
the driver sends the resolved configs; each rank builds its Worker; every rank reports how that went,
so a rank that failed to start is named, with its traceback, on the driver's terminal.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import traceback
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from pagedserve import ops
from pagedserve.distributed.context import DRIVER_RANK, ParallelContext
from pagedserve.engine_config import EngineConfig
from pagedserve.models.model_config import ModelConfig
from pagedserve.worker.worker import Worker

logger = logging.getLogger("pagedserve")

TIMEOUT_ENV = "PAGEDSERVE_TP_TIMEOUT_S"
# How long a rank waits for its peers inside a step (a collective) before the engine calls the group
# dead. Steps run in lockstep, so this bounds the skew between ranks plus one rank's longest stall.
DEFAULT_TIMEOUT_S = 120.0
# Spawned ranks import torch and pagedserve before they reach the store: seconds on a busy machine.
STARTUP_TIMEOUT_S = 300.0
JOINED_KEY = "pagedserve/ranks_joined"  # each spawned rank adds 1 once it reached the store
# Between steps a rank waits on the control group for as long as the engine idles.
_IDLE_TIMEOUT = timedelta(days=365)


def step_timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def make_worker(config: EngineConfig, model_config: ModelConfig, eos_token_ids: Sequence[int]):
    """The engine's worker: a Worker, or with tensor_parallel_size > 1 the driver of a group (DriverWorker)."""
    world = config.tensor_parallel_size
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {world}")
    if world == 1:
        return Worker(config, model_config, eos_token_ids)
    from pagedserve.distributed.driver import DriverWorker, RankProcesses

    backend = check_backend(model_config.device, world)
    if launched_by_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world or int(os.environ["RANK"]) != DRIVER_RANK:
            raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes (this is rank "
                             f"{os.environ['RANK']}) for tensor_parallel_size={world}: start one process per rank, "
                             "and the engine on rank 0 only")
        parallel = init_groups(DRIVER_RANK, world, backend, None)
        ranks = RankProcesses([], world)
    else:
        from pagedserve.distributed.rank_worker import spawn_ranks

        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
        ranks = RankProcesses(spawn_ranks(world, store.port, backend), world)
        try:
            wait_for_ranks(store, world, ranks)
            parallel = init_groups(DRIVER_RANK, world, backend, store)
        except Exception as error:
            ranks.stop()
            raise ranks.failure(error) from error
    try:
        worker = start_rank(parallel, (config, model_config, list(eos_token_ids)))
    except Exception:
        ranks.stop()
        dist.destroy_process_group()
        raise
    return DriverWorker(worker, parallel, ranks)


def wait_for_ranks(store: dist.Store, world: int, ranks) -> None:
    """Waits until the spawned ranks reached the store, failing at once when one of them died first
    (an import error, say; its traceback is on stderr), or after STARTUP_TIMEOUT_S."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while store.add(JOINED_KEY, 0) < world - 1:
        dead = ranks.dead()
        if dead is not None:
            raise dead
        if time.monotonic() > deadline:
            raise TimeoutError(f"the tensor-parallel ranks did not start within {STARTUP_TIMEOUT_S:.0f} s")
        time.sleep(0.02)


def check_backend(device: torch.device, world: int) -> str:
    if device.type == "cuda":
        if torch.cuda.device_count() < world:
            raise ValueError(f"tensor_parallel_size={world} needs {world} GPUs, this machine shows "
                             f"{torch.cuda.device_count()}")
        return "nccl"
    if device.type != "cpu":
        raise ValueError(f"tensor parallelism runs on cuda or cpu, not {device.type}")
    return "gloo"


def init_groups(rank: int, world: int, backend: str, store: Optional[dist.Store]) -> ParallelContext:
    """This process's ParallelContext: the default (device) group, then the control group."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process: one tensor-parallel engine "
                           "per process (shut the other one down first)")
    timeout = timedelta(seconds=step_timeout_s())
    if store is None:  # torchrun: env:// rendezvous
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    # A gloo timeout is each process's own: the driver's sends give up on a hung rank after the step
    # timeout, while the ranks wait for the next step for as long as the engine idles.
    control = dist.new_group(backend="gloo", timeout=timeout if rank == DRIVER_RANK else _IDLE_TIMEOUT)
    return ParallelContext(rank, world, dist.group.WORLD, control)


def local_rank(parallel: ParallelContext) -> int:
    return int(os.environ.get("LOCAL_RANK", parallel.rank))


def ranks_on_this_node(parallel: ParallelContext) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", parallel.world_size))


def start_rank(parallel: ParallelContext, configs: Optional[tuple]) -> Worker:
    """Every rank: receive the driver's configs (the driver passes them), build this rank's Worker, and
    agree that every rank did. When one failed, every rank raises: the driver its own exception if it
    failed too (the ranks' usually fail alike: a ValueError stays a ValueError), else a RuntimeError
    naming the ranks that failed, with their tracebacks."""
    box = [configs]
    dist.broadcast_object_list(box, src=DRIVER_RANK, group=parallel.control)
    config, model_config, eos_token_ids = box[0]
    worker, error, failure = None, None, None
    try:
        worker = Worker(config, _on_this_rank(model_config, parallel), eos_token_ids, parallel)
    except Exception as caught:
        error, failure = caught, traceback.format_exc()
    reports: list = [None] * parallel.world_size
    dist.all_gather_object(reports, failure, group=parallel.control)
    failed = [(rank, text) for rank, text in enumerate(reports) if text is not None]
    if error is not None and parallel.is_driver:
        raise error
    if failed:
        details = "\n".join(f"--- rank {rank} ---\n{text}" for rank, text in failed)
        names = ", ".join(f"rank {rank}" for rank, _ in failed)
        raise RuntimeError(f"tensor-parallel {names} failed to start:\n{details}")
    assert worker is not None
    return worker


def _on_this_rank(model_config: ModelConfig, parallel: ParallelContext) -> ModelConfig:
    """The model config on this rank's device, with this rank's share of the CPU's cores."""
    if model_config.device.type == "cuda":
        device = torch.device("cuda", local_rank(parallel))
        torch.cuda.set_device(device)
        return dataclasses.replace(model_config, device=device)
    threads = max(1, (os.cpu_count() or 1) // ranks_on_this_node(parallel))
    ops.set_num_threads(threads)
    torch.set_num_threads(threads)
    return model_config
