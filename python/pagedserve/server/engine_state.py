"""The engine view behind GET /v1/engine/state (and the page's live panel).

read_engine_state runs on the engine loop thread between steps, so the
engine's snapshot (block map, queues, stats) is one consistent moment; the
loop adds its own step history for the batch-composition chart.
"""

from __future__ import annotations

from dataclasses import asdict


def read_engine_state(engine, loop) -> dict:
    """engine.snapshot() plus the loop's step count and recent steps (engine: an EngineClient)."""
    state = dict(engine.snapshot())
    state["num_steps"] = loop.state.num_steps
    state["steps"] = [asdict(step) for step in loop.state.steps]
    return state
