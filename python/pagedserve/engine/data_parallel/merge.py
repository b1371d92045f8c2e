"""The replicas' stats and engine-page snapshots as one engine's, with the per-replica breakdown kept
under "replicas" (the server's /metrics labels each replica's gauges replica="i" from it)."""

from __future__ import annotations

from typing import Sequence

# Fractions recomputed from the summed counts they are made of; every other number is summed.
_STEP_KEYS = ("step_num_seqs", "step_prefill_tokens", "step_decode_tokens")


def merge_stats(per_replica: Sequence[dict], step: dict) -> dict:
    """One engine's stats() from the replicas' latest; `step` holds the step_* sums of the replica steps
    drained by the last step() call, and their durations ("replica_step_seconds")."""
    merged: dict = {}
    for stats in per_replica:
        for key, value in stats.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                merged[key] = merged.get(key, 0) + value
    blocks = merged.get("num_blocks", 0)
    merged["pool_utilization"] = (sum(s.get("pool_utilization", 0.0) * s.get("num_blocks", 0) for s in per_replica)
                                  / blocks if blocks else 0.0)
    queried = merged.get("prefix_queried_blocks", 0)
    merged["prefix_hit_rate"] = merged.get("prefix_hit_blocks", 0) / queried if queried else 0.0
    for key in _STEP_KEYS:
        merged[key] = step.get(key, 0)
    merged["replica_step_seconds"] = list(step.get("replica_step_seconds", []))
    merged["replicas"] = [dict(s, replica=i) for i, s in enumerate(per_replica)]
    return merged


def merge_snapshots(snapshots: Sequence[dict], stats: dict, about: Sequence[dict]) -> dict:
    """The engine page's view of N replicas: one block map (replica 0's blocks first), the queues with
    each request's replica, and "replicas": what `about` says of each (pid, device) with its stats and
    its range in the block map."""
    block_states, replicas, start = [], [], 0
    running, waiting = [], []
    for i, (snap, extra) in enumerate(zip(snapshots, about, strict=True)):
        states = snap["block_states"]
        block_states.append(states)
        replicas.append({"replica": i, **extra, "stats": snap["stats"],
                         "num_unfinished_requests": snap["num_unfinished_requests"],
                         "num_running": len(snap["running"]), "num_waiting": len(snap["waiting"]),
                         "block_range": [start, start + len(states)]})
        start += len(states)
        running += [dict(r, replica=i) for r in snap["running"]]
        waiting += [dict(r, replica=i) for r in snap["waiting"]]
    first = snapshots[0]
    return {"stats": stats, "block_size": first["block_size"], "block_states": "".join(block_states),
            "block_state_names": first["block_state_names"], "running": running, "waiting": waiting,
            "num_unfinished_requests": sum(s["num_unfinished_requests"] for s in snapshots),
            "replicas": replicas}
