"""The engine view behind GET /v1/engine/state (and the page's live panel).

read_engine_state runs on the engine loop thread between steps, so the
block map, the queues and the stats it returns are one consistent moment.
"""

from __future__ import annotations

from dataclasses import asdict

# BlockState byte values (0 free, 1 in use, 2 shared, 3 cached/evictable) as the digits '0'..'3':
# one character per block keeps the JSON small for pools of many thousand blocks.
_BLOCK_STATE_DIGITS = bytes.maketrans(bytes(range(10)), b"0123456789")
BLOCK_STATE_NAMES = {"0": "free", "1": "in_use", "2": "shared", "3": "cached"}


def _request_ids(engine, seq_ids) -> list[str]:
    """Request ids of scheduler sequences, each once, in queue order."""
    ids: dict[str, None] = {}
    for seq_id in seq_ids:
        rid = engine.request_id_of(seq_id)
        if rid is not None:
            ids.setdefault(rid)
    return list(ids)


def _request_summary(engine, rid: str) -> dict:
    request = engine.requests.get(rid)
    if request is None:
        return {"id": rid}
    return {"id": rid, "prompt_tokens": len(request.prompt_token_ids), "n": len(request.samples),
            "output_tokens": max((len(s.token_ids) for s in request.samples), default=0)}


def read_engine_state(engine, loop) -> dict:
    scheduler = engine.scheduler
    states = bytes(scheduler.pool.block_states()).translate(_BLOCK_STATE_DIGITS).decode("ascii")
    running = _request_ids(engine, scheduler.running_ids)
    in_batch = set(running)  # a request with n > 1 may have samples in both queues
    waiting = [rid for rid in _request_ids(engine, scheduler.waiting_ids) if rid not in in_batch]
    return {
        "stats": engine.stats(),
        "block_size": scheduler.config.block_size,
        "block_states": states,
        "block_state_names": BLOCK_STATE_NAMES,
        "running": [_request_summary(engine, rid) for rid in running],
        "waiting": [_request_summary(engine, rid) for rid in waiting],
        "num_unfinished_requests": engine.get_num_unfinished_requests(),
        "num_steps": loop.state.num_steps,
        "steps": [asdict(step) for step in loop.state.steps],
    }
