"""Helpers shared by the tests that drive an LLMEngine step by step."""

from __future__ import annotations


def finished_outputs(engine) -> dict:
    """Steps `engine` until nothing is left; each request's final RequestOutput by request id."""
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals
