"""Ranks 1..N-1: build this rank's shard of the worker, then run every step the driver sends.

The loop receives a message (step_broadcast.py), runs the step through the rank's own ModelRunner -
its block copies on its KV-cache shard (the block ids are the driver's), the forward over its shard
with the driver's all-reduces, the gather of its logits to the driver, the prompt-logprob
recomputes - and waits for the next, until the driver says stop. It never samples.

A spawned rank watches its parent: if the engine's process goes away (killed, crashed), the rank
exits within half a second rather than linger as an orphan.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import torch.distributed as dist

from pagedserve.distributed.context import ParallelContext
from pagedserve.distributed.step_broadcast import STEP, STOP, StepChannel, decode_step

logger = logging.getLogger("pagedserve")

_PARENT_POLL_S = 0.5


def spawn_ranks(world: int, port: int, backend: str) -> list:
    """Starts ranks 1..world-1 (start method spawn) that meet rank 0 at the TCPStore on 127.0.0.1:port."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    processes = []
    for rank in range(1, world):
        process = context.Process(target=spawned_rank_main, args=(rank, world, port, backend, os.getpid()),
                                  name=f"pagedserve-tp-rank-{rank}", daemon=True)
        process.start()
        processes.append((rank, process))
    return processes


def spawned_rank_main(rank: int, world: int, port: int, backend: str, parent_pid: int) -> None:
    """A spawned rank's process: join the group at the driver's store, then follow the driver."""
    from datetime import timedelta

    from pagedserve.distributed.launch import JOINED_KEY, STARTUP_TIMEOUT_S, init_groups

    _exit_with_parent(parent_pid)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    store.add(JOINED_KEY, 1)
    code = follow(init_groups(rank, world, backend, store))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: gloo's threads may still hold a group it would abort on


def follow(parallel: ParallelContext) -> int:
    """Builds this rank's Worker and runs the driver's steps until it says stop; the exit status."""
    from pagedserve.distributed.launch import start_rank

    try:
        worker = start_rank(parallel, None)
    except RuntimeError as error:  # every rank raises it; the driver reports it with the tracebacks
        logger.debug("%s", error)
        return 1  # the process ends here: its group goes with it
    channel = StepChannel(parallel)
    while True:
        command, payload = channel.receive()
        if command == STOP:
            break
        if command != STEP:
            raise RuntimeError(f"rank {parallel.rank}: unknown command {command} from the driver")
        step, plan = decode_step(payload)
        worker.execute_async(step, None, None, plan)
    worker.close()  # its CUDA graphs first: NCCL's destroy waits for the graphs that captured it
    dist.destroy_process_group()
    return 0


def _exit_with_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
