"""The engine page's view of the engine (GET /v1/engine/state): one consistent moment,
taken between steps, of the block map, the queues and the stats."""

from __future__ import annotations

from pagedserve.engine.sequences import Sequences

# BlockState byte values (0 free, 1 in use, 2 shared, 3 cached/evictable) as the digits '0'..'3':
# one character per block keeps the JSON small for pools of many thousand blocks.
_BLOCK_STATE_DIGITS = bytes.maketrans(bytes(range(10)), b"0123456789")
BLOCK_STATE_NAMES = {"0": "free", "1": "in_use", "2": "shared", "3": "cached"}


def engine_snapshot(scheduler, sequences: Sequences, requests: dict, stats: dict) -> dict:
    states = bytes(scheduler.pool.block_states()).translate(_BLOCK_STATE_DIGITS).decode("ascii")
    running = _request_ids(sequences, scheduler.running_ids)
    in_batch = set(running)  # a request with n > 1 may have samples in both queues
    waiting = [rid for rid in _request_ids(sequences, scheduler.waiting_ids) if rid not in in_batch]
    return {
        "stats": stats,
        "block_size": scheduler.config.block_size,
        "block_states": states,
        "block_state_names": BLOCK_STATE_NAMES,
        "running": [_request_summary(requests, rid) for rid in running],
        "waiting": [_request_summary(requests, rid) for rid in waiting],
        "num_unfinished_requests": len(requests),
    }


def _request_ids(sequences: Sequences, seq_ids) -> list[str]:
    """Request ids of scheduler sequences, each once, in queue order."""
    ids: dict[str, None] = {}
    for seq_id in seq_ids:
        owner = sequences.get(seq_id)
        if owner is not None:
            ids.setdefault(owner[0].request_id)
    return list(ids)


def _request_summary(requests: dict, rid: str) -> dict:
    request = requests.get(rid)
    if request is None:
        return {"id": rid}
    return {"id": rid, "prompt_tokens": len(request.prompt_token_ids), "n": len(request.samples),
            "output_tokens": max((len(s.token_ids) for s in request.samples), default=0)}
