"""What crosses the pipes between the server process and a replica process (pickled by
multiprocessing's Connection). Commands go down, one pipe per replica; reports come up on another.

Outputs travel without their prompt (text and token ids): the parent has both and puts them back, so
a step's message stays a few hundred bytes per request however long the prompts are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

# ---------------------------------------------------------------------------------------- commands (down)


@dataclass
class Add:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: Any  # SamplingParams
    arrival_time: float


@dataclass
class Abort:
    request_ids: list[str]


@dataclass
class Snapshot:
    token: int  # echoed in the reply


@dataclass
class Stop:
    pass


# ----------------------------------------------------------------------------------------- reports (up)


@dataclass
class Ready:
    pid: int
    info: Any  # EngineInfo with tokenizer=None (the parent loads its own)
    has_tokenizer: bool
    eos_token_ids: list[int]
    block_size: int  # of its KV cache (the router hashes prompt prefixes by it)
    stats: dict


@dataclass
class LoadFailed:
    message: str
    bad_input: bool  # a ValueError (bad option or path): the message says it all


@dataclass
class Outputs:
    outputs: list  # RequestOutput deltas, prompt stripped
    stats: dict  # engine.stats() after it
    stepped: bool  # a step ran (else only commands were applied): its step_* stats are this step's
    step_seconds: float = 0.0  # how long that step took


@dataclass
class SnapshotReply:
    token: int
    snapshot: dict


@dataclass
class StepFailed:
    """engine.step() raised an ordinary exception: the replica aborted its requests and serves on."""
    message: str


@dataclass
class Dead:
    """The replica's engine raised EngineDeadError (e.g. one of its tensor-parallel ranks died)."""
    who: str
    why: str


@dataclass
class Beat:
    """Sent every HEARTBEAT_SECONDS by a thread of its own: the process is alive and not frozen."""
    pass
