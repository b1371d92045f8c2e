"""The driver's side of a tensor-parallel group: its worker, the ranks' processes, and failure.

DriverWorker is what the engine holds in place of a Worker: each step goes first to every other rank
(one message on the control group), then through the driver's own Worker, whose forward joins the
ranks' collectives and whose sampler alone draws tokens. Whatever goes wrong in a step - a rank that
died (its connection drops and the collective fails at once) or hangs (the collective times out) -
becomes EngineDeadError naming the rank and why, and the engine stays dead: every later step raises
the same error. check_health() finds a dead rank between steps too.

On NCCL a dead peer fails nothing by itself: the driver's collective kernels spin on the GPU for it,
and the step's result never arrives. So with spawned ranks on CUDA a watcher thread waits on the
ranks' process sentinels and, when one ends while the engine runs, aborts the NCCL communicators
(the spinning kernels then end); the step's result is then refused with the rank's EngineDeadError.
Shutting down destroys the groups on every rank together (NCCL's destroy is collective), after
the stop message and the CUDA graphs that captured them (NCCL's destroy waits for those), and before
the ranks are joined; after a failure the groups are aborted instead.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import weakref
from multiprocessing.connection import wait
from typing import Optional

import torch.distributed as dist

from pagedserve.distributed.context import ParallelContext
from pagedserve.distributed.step_broadcast import StepChannel
from pagedserve.errors import EngineDeadError

logger = logging.getLogger("pagedserve")

# A rank killed mid-step: its collective fails before the OS has reaped it; wait this long for its exit code.
_EXIT_GRACE_S = 2.0
_STOP_GRACE_S = 5.0


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class RankProcesses:
    """Ranks 1..N-1 as this process's children (spawned), or none (torchrun owns them)."""

    def __init__(self, processes: list, world_size: int):
        self.processes = processes  # (rank, multiprocessing.Process)
        # Who a timed-out collective waited for: the one other rank, or any of them.
        self.others = "rank 1" if world_size == 2 else f"one of ranks 1-{world_size - 1}"

    def dead(self) -> Optional[EngineDeadError]:
        for rank, process in self.processes:
            if process.exitcode is not None:
                return EngineDeadError(f"rank {rank}", describe_exit(process.exitcode))
        return None

    def failure(self, error: BaseException) -> EngineDeadError:
        """The EngineDeadError a failed collective means: a rank that exited, else the collective's own error."""
        deadline = time.monotonic() + (_EXIT_GRACE_S if self.processes else 0.0)
        while True:
            dead = self.dead()
            if dead is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if dead is not None:
            return dead
        if isinstance(error, EngineDeadError):
            return error
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if "timed out" in text.lower() or "timeout" in text.lower():
            return EngineDeadError(self.others, f"did not answer in time ({text})")
        return EngineDeadError("the tensor-parallel group", f"a step failed: {type(error).__name__}: {text}")

    def stop(self, grace_s: float = _STOP_GRACE_S) -> None:
        """Waits up to grace_s for the ranks to leave, then terminates (and kills) the rest."""
        deadline = time.monotonic() + grace_s
        for _, process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for _, process in self.processes:
            if process.exitcode is None:
                process.terminate()
                process.join(1.0)
            if process.exitcode is None:
                process.kill()
                process.join(1.0)


class DriverWorker:
    """Rank 0's worker: the engine's Worker interface over a tensor-parallel group."""

    def __init__(self, worker, parallel: ParallelContext, ranks: RankProcesses):
        self.worker = worker
        self.kv_plan = worker.kv_plan
        self.device = worker.device
        self.sampler = worker.sampler
        self.model = worker.model
        self.parallel = parallel
        self.channel = StepChannel(parallel)
        self.ranks = ranks
        self._dead: Optional[EngineDeadError] = None
        self._state = {"closed": False, "failed": False}  # shared with the finalizer, which must not hold self
        self._closer = weakref.finalize(self, _close, self.channel, ranks, self._state, worker)
        if ranks.processes and dist.get_backend() == "nccl":
            threading.Thread(target=_watch_ranks, args=(ranks, self._state, worker), name="pagedserve-rank-watch",
                             daemon=True).start()

    def execute_async(self, step, rows, grammar=None, prompt_plan=None, last_ids=None):
        if last_ids is not None:  # engine_config.resolve_async_scheduling keeps run-ahead to one process
            raise ValueError("a tensor-parallel group takes every input id from the driver; it cannot run ahead")
        self.check_health()
        try:
            self.channel.send_step(step, prompt_plan)
            return _Checked(self.worker.execute_async(step, rows, grammar, prompt_plan), self)
        except Exception as error:
            self._dead = self.ranks.failure(error)
            logger.error("tensor-parallel engine failed: %s", self._dead)
            self._state["failed"] = True
            self.close()
            raise self._dead from error

    def check_health(self) -> None:
        """Raises EngineDeadError when a rank has died (or an earlier step failed)."""
        if self._dead is None:
            self._dead = self.ranks.dead()
            if self._dead is not None:
                self._state["failed"] = True
                self.close()
        if self._dead is not None:
            raise self._dead

    def close(self) -> None:
        """Stops the ranks and the group: a stop message while the group is healthy, then signals for the
        ranks that do not leave (at once after a failure: a hung rank would never read the message)."""
        self._closer()


class _Checked:
    """A step's pending result that is refused when a rank died while it ran (its values are void then:
    the collectives were aborted)."""

    def __init__(self, pending, driver: DriverWorker):
        self.pending, self.driver = pending, driver

    def result(self):
        value = self.pending.result()
        self.driver.check_health()
        return value

    def __getattr__(self, name):
        return getattr(self.pending, name)


def _watch_ranks(ranks: RankProcesses, state: dict, worker) -> None:
    """Waits for a rank's process to end; one that ends while the engine runs gets the NCCL groups aborted
    (after the CUDA graphs that captured them are destroyed: NCCL's abort waits for those)."""
    wait([process.sentinel for _, process in ranks.processes])
    with _GROUPS_LOCK:
        if state["closed"] or not dist.is_initialized():
            return
        state["failed"] = True
        logger.error("tensor-parallel %s: aborting the NCCL communicators", ranks.dead())
        worker.abandon_graphs()
        dist.distributed_c10d._abort_process_group()


_GROUPS_LOCK = threading.Lock()  # the watcher's abort and the shutdown's destroy, one at a time


def _close(channel: StepChannel, ranks: RankProcesses, state: dict, worker) -> None:
    with _GROUPS_LOCK:
        if state["closed"]:
            return
        state["closed"] = True
        healthy = not state["failed"] and ranks.dead() is None
        if healthy:
            try:
                channel.send_stop()
            except Exception:  # a rank already gone: the signals below end the rest
                healthy = False
        if healthy:
            worker.close()  # its CUDA graphs hold the communicators
        if dist.is_initialized():
            if healthy or dist.get_backend() != "nccl":
                dist.destroy_process_group()  # the ranks destroy theirs on the stop message
            else:
                worker.abandon_graphs()
                dist.distributed_c10d._abort_process_group()  # a destroy would wait for the dead rank
    ranks.stop(_STOP_GRACE_S if healthy else 0.0)
