"""The replica process: one LLMEngine of its own, driven over two pipes by the server process.

    replica_main(placement, config, commands, reports)   # the target of a spawned process

Its main thread loads the engine, reports Ready, then loops on its own: apply the commands that came
(add, abort, snapshot, stop), run one step while anything is unfinished, and send the step's outputs up
at once, so the N replicas step concurrently and the server only drains what arrived. Two small threads
keep it honest: one moves commands from the pipe into a queue (the server never blocks on a replica
busy stepping) and exits the process when the pipe ends without a Stop (the server died: no orphan
stays behind); one sends a Beat every HEARTBEAT_SECONDS, so the server can tell a frozen process from
a long step (the ops release the GIL, so the beat goes on through a step).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Optional

from pagedserve.engine.data_parallel.messages import (Abort, Add, Beat, Dead, LoadFailed, Outputs, Ready, Snapshot,
                                                      SnapshotReply, StepFailed, Stop)
from pagedserve.engine.data_parallel.placement import ReplicaPlacement
from pagedserve.engine_config import EngineConfig
from pagedserve.errors import EngineDeadError, RequestError
from pagedserve.outputs import CompletionOutput, RequestMetrics, RequestOutput

HEARTBEAT_SECONDS = 0.5

logger = logging.getLogger("pagedserve.replica")


def replica_main(placement: ReplicaPlacement, config: EngineConfig, commands: Connection,
                 reports: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the server stops us
    _configure_logging(placement.index)
    _settle_devices(placement)
    channel = _Channel(reports)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_commands, args=(commands, inbox, placement.index), name="replica-commands",
                     daemon=True).start()
    threading.Thread(target=_beat, args=(channel,), name="replica-heartbeat", daemon=True).start()
    engine = _load_engine(placement, config, channel)
    info = engine.info()
    channel.send(Ready(os.getpid(), dataclasses.replace(info, tokenizer=None), info.tokenizer is not None,
                       list(engine.eos_token_ids), engine.snapshot()["block_size"], engine.stats()))
    try:
        code = ReplicaLoop(engine, inbox, channel).run()
    except Exception as err:  # a bug in the loop: say so, rather than leave the server a bare exit status
        logger.exception("the replica's loop failed")
        channel.send(Dead("its loop", f"{type(err).__name__}: {err}"))
        code = 1
    if code == 0:
        engine.shutdown()
    _exit(code)


def _load_engine(placement: ReplicaPlacement, config: EngineConfig, channel: "_Channel"):
    """The replica's LLMEngine (one engine: data_parallel_size 1); a failure is reported and ends the process."""
    try:
        from pagedserve.engine.engine import LLMEngine
        return LLMEngine(config.with_updates(data_parallel_size=1, device=placement.device_type))
    except BaseException as err:  # noqa: BLE001 - whatever it is, the server must hear it and say it
        bad_input = isinstance(err, ValueError)  # a bad option or path: the message says it all
        if not bad_input:
            logger.exception("the model failed to load")
        channel.send(LoadFailed(str(err) if bad_input else f"{type(err).__name__}: {err}", bad_input))
        _exit(1)


class ReplicaLoop:
    """The replica's own engine loop (its main thread)."""

    def __init__(self, engine, inbox: queue.SimpleQueue, channel: "_Channel"):
        self.engine = engine
        self._inbox = inbox
        self._channel = channel
        self._live: set[str] = set()  # request ids added and not yet finished or aborted

    def run(self) -> int:
        """Serves until Stop (0) or until the engine failed for good (1)."""
        while True:
            busy = self.engine.has_unfinished_requests()
            commands = self._take(block=not busy)
            for command in commands:
                if isinstance(command, Stop):
                    return 0
                self._apply(command)
            outputs, stepped, seconds = [], False, 0.0
            if self.engine.has_unfinished_requests():
                start = time.perf_counter()
                try:
                    outputs, stepped = self._step(), True
                except EngineDeadError as err:
                    self._channel.send(Dead(err.who, err.why))
                    return 1
                seconds = time.perf_counter() - start
            if commands or stepped:
                self._channel.send(Outputs(outputs, self.engine.stats(), stepped, seconds))

    def _take(self, block: bool) -> list:
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command) -> None:
        if isinstance(command, Add):
            self._add(command)
        elif isinstance(command, Abort):
            live = [rid for rid in command.request_ids if rid in self._live]
            self._live.difference_update(live)
            self.engine.abort_request(live)  # the server made the "abort" finals itself
        elif isinstance(command, Snapshot):
            self._channel.send(SnapshotReply(command.token, self.engine.snapshot()))
        else:
            raise TypeError(f"unknown replica command {command!r}")

    def _add(self, command: Add) -> None:
        prompt = {"prompt": command.prompt, "prompt_token_ids": command.prompt_token_ids}
        try:
            self.engine.add_request(command.request_id, prompt, command.params, arrival_time=command.arrival_time)
        except RequestError as err:  # the server checked it before sending: report it, never crash on it
            logger.error("replica refused request %s after the server accepted it: %s", command.request_id, err)
            self._channel.send(Outputs([_refused(command, err.message)], self.engine.stats(), False))
            return
        self._live.add(command.request_id)

    def _step(self) -> list:
        try:
            outputs = self.engine.step()
        except EngineDeadError:
            raise
        except Exception as err:  # as the server does with one engine: fail what runs, serve on
            logger.exception("engine.step() failed; aborting the replica's requests")
            self.engine.abort_request(sorted(self._live))
            self._live.clear()
            self._channel.send(StepFailed(f"{type(err).__name__}: {err}"))
            return []
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
            out.prompt, out.prompt_token_ids = None, []  # the server has them (messages.py)
        return outputs


def _refused(command: Add, message: str) -> RequestOutput:
    n = command.params.n
    return RequestOutput(command.request_id, None, [], [CompletionOutput(i, "", [], finish_reason="abort")
                                                        for i in range(n)], True,
                         RequestMetrics(arrival_time=command.arrival_time, finished_time=time.monotonic()),
                         error=message)


class _Channel:
    """The report pipe, shared by the main thread and the heartbeat thread."""

    def __init__(self, connection: Connection):
        self._connection = connection
        self._lock = threading.Lock()

    def send(self, message) -> None:
        try:
            with self._lock:
                self._connection.send(message)
        except (BrokenPipeError, EOFError, OSError):  # the server is gone
            _exit(0)


def _read_commands(connection: Connection, inbox: queue.SimpleQueue, index: int) -> None:
    while True:
        try:
            command = connection.recv()
        except (EOFError, OSError):
            print(f"pagedserve replica {index}: the server went away; exiting", file=sys.stderr, flush=True)
            _exit(0)
        inbox.put(command)
        if isinstance(command, Stop):
            return


def _beat(channel: _Channel) -> None:
    while True:
        channel.send(Beat())
        time.sleep(HEARTBEAT_SECONDS)


def _settle_devices(placement: ReplicaPlacement) -> None:
    """The replica's share of the machine, set before anything touches a device."""
    if placement.cuda_visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = placement.cuda_visible_devices
    import torch

    from pagedserve import ops
    torch.set_num_threads(placement.num_threads)
    ops.set_num_threads(placement.num_threads)


def _configure_logging(index: int) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s replica {index} %(name)s: %(message)s")


def _exit(code: Optional[int]) -> None:
    """Leaves at once: no atexit work that could wait on a dead peer."""
    sys.stderr.flush()
    os._exit(code or 0)

