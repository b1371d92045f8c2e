"""ReplicaHandle: the server's side of one replica process.

It starts the process (spawned: a fresh interpreter, no inherited CUDA state or threads) over two
one-way pipes, and keeps two daemon threads so the engine loop never blocks on a replica: a sender
(commands queue up here and go down the pipe as the replica reads them) and a receiver (reports come
up into the inbox every replica shares, tagged with the replica's index; it notes when it last heard
anything, and puts PipeClosed when the pipe ends, which is at once when the process dies).
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from typing import Optional

from pagedserve.engine.data_parallel.messages import Beat, Stop
from pagedserve.engine.data_parallel.placement import ReplicaPlacement
from pagedserve.engine.data_parallel.replica_process import HEARTBEAT_SECONDS, replica_main
from pagedserve.engine_config import EngineConfig

# A replica that sent nothing (not even a heartbeat) this long is hung: 6 missed beats, so a frozen
# replica is reported within the 5 s the issue allows even while idle (the loop asks every second).
SILENCE_LIMIT_SECONDS = 6 * HEARTBEAT_SECONDS


class PipeClosed:
    """The replica's report pipe ended: the process exited or was killed."""


class ReplicaHandle:
    def __init__(self, placement: ReplicaPlacement, config: EngineConfig, inbox: queue.SimpleQueue, context):
        self.index = placement.index
        self.placement = placement
        command_end, self._commands = context.Pipe(duplex=False)
        self._reports, report_end = context.Pipe(duplex=False)
        self.process = context.Process(target=replica_main, args=(placement, config, command_end, report_end),
                                       name=f"pagedserve-replica-{self.index}")
        self.process.start()
        command_end.close()  # the child's ends: closed here, so the pipes end when the child does
        report_end.close()
        self.pid = self.process.pid
        self._inbox = inbox
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._last_heard = time.monotonic()
        self._watch_silence = False  # from Ready on; loading may take minutes without a beat
        threading.Thread(target=self._send_loop, name=f"replica-{self.index}-sender", daemon=True).start()
        threading.Thread(target=self._receive_loop, name=f"replica-{self.index}-receiver", daemon=True).start()

    # ------------------------------------------------------------------ commands
    def send(self, command) -> None:
        self._outbox.put(command)

    def _send_loop(self) -> None:
        while True:
            command = self._outbox.get()
            try:
                self._commands.send(command)
            except (BrokenPipeError, OSError):  # the replica is gone: the receiver reports it
                return
            if isinstance(command, Stop):
                return

    # ------------------------------------------------------------------ reports
    def _receive_loop(self) -> None:
        while True:
            try:
                message = self._reports.recv()
            except (EOFError, OSError):
                self._inbox.put((self.index, PipeClosed()))
                return
            self._last_heard = time.monotonic()
            if not isinstance(message, Beat):
                self._inbox.put((self.index, message))

    def watch_silence(self) -> None:
        """From now on a replica silent for SILENCE_LIMIT_SECONDS counts as hung."""
        self._last_heard = time.monotonic()
        self._watch_silence = True

    # ------------------------------------------------------------------ liveness
    def failure(self) -> Optional[str]:
        """Why this replica cannot serve (its process ended, or it went silent), or None."""
        code = self.process.exitcode
        if code is not None:
            return describe_exit(code)
        silent = time.monotonic() - self._last_heard
        if self._watch_silence and silent > SILENCE_LIMIT_SECONDS:
            return f"no sign of life for {silent:.1f} s (the process is hung or stopped)"
        return None

    def wait_exit(self, timeout: float) -> Optional[int]:
        """The exit code once the process ended within `timeout` seconds (None: still running)."""
        self.process.join(timeout)
        return self.process.exitcode

    # ------------------------------------------------------------------ stopping
    def request_stop(self) -> None:
        """Asks the replica to stop (it aborts what it runs, frees its device and exits 0)."""
        if self.process.exitcode is None:
            self.send(Stop())

    def kill(self) -> None:
        if self.process.exitcode is None:
            self.process.kill()
        self.process.join(5)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the process was killed by {name}"
    return f"the process exited with status {code}"
