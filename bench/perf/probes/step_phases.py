"""Where a step's host time goes: the engine's step phases timed inclusively (a wrapper around each), per step,
for 64 requests unconstrained and under a JSON schema with the grammar thread on and off, interleaved.

    python bench/perf/probes/step_phases.py [--device cuda] [--rounds 2] [--max-tokens 128]
    python bench/perf/probes/step_phases.py --quick --device cpu   # 4 requests, 8 tokens, one round: it runs

A probe, not a benchmark: the wrappers add ~1 us a call. Phases nest (launch holds execute_async, which holds
sampling_rows, which holds catch_up ...), so rows do not add up.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from structured_bench import LONG_SCHEMA, PROMPT  # noqa: E402

import torch  # noqa: E402

TIMES: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)


def timed(name, fn):
    def wrapper(*a, **k):
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TIMES[name] += time.perf_counter() - start
            CALLS[name] += 1
    return wrapper


class SchedulerProxy:
    def __init__(self, scheduler):
        self._s = scheduler
        for name in ("schedule", "advance", "commit", "update"):
            setattr(self, name, timed(f"scheduler.{name}", getattr(scheduler, name)))

    def __getattr__(self, name):
        return getattr(self._s, name)


def instrument(engine) -> None:
    from pagedserve.sample import pending

    engine.scheduler = SchedulerProxy(engine.scheduler)
    for name in ("step", "_launch", "_sampling_rows", "_catch_up", "_commit_advanced", "_record_last_step"):
        setattr(engine, name, timed(f"engine.{name}", getattr(engine, name)))
    engine.worker.execute_async = timed("worker.execute_async", engine.worker.execute_async)
    engine._recorder.emit = timed("recorder.emit", engine._recorder.emit)
    engine._recorder.record = timed("recorder.record", engine._recorder.record)
    g = engine.grammars
    g.fill = timed("grammars.fill", g.fill)
    g.fill_threaded = timed("grammars.fill_threaded", g.fill_threaded)
    g.step = timed("grammars.step", g.step)
    g._drawn = timed("grammars._drawn", g._drawn)
    if g._thread is not None:
        settle = g._thread.settle
        g._thread.submit = timed("thread.submit", g._thread.submit)

        def settled(keep_newest: bool = False):
            start = time.perf_counter()
            jobs = settle(keep_newest)
            TIMES["thread.settle"] += time.perf_counter() - start
            CALLS["thread.settle"] += 1
            for job in jobs:
                TIMES["(thread) job"] += job.seconds
                CALLS["(thread) job"] += 1
            return jobs
        g._thread.settle = settled
    pending.PendingSamples.result = timed("pending.result", pending.PendingSamples.result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="4 requests, 8 tokens, one round: checks the script works")
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.max_tokens, args.rounds = 4, 8, 1
    from pagedserve import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(device=args.device, seed=0, structured_outputs_thread="on", async_scheduling="on")
    engine = llm.llm_engine
    thread = engine.grammars._thread
    plain = SamplingParams(temperature=0.7, max_tokens=args.max_tokens, ignore_eos=True)
    json_ = SamplingParams(temperature=0.7, max_tokens=args.max_tokens,
                           structured_outputs=StructuredOutputsParams(json=LONG_SCHEMA))
    llm.generate([PROMPT] * 4, json_, use_tqdm=False)  # compiles, starts the thread
    instrument(engine)
    cases = [("unconstrained", plain, thread), ("json, thread", json_, thread), ("json, engine's thread", json_, None)]
    for r in range(args.rounds):
        for name, params, grammar_thread in cases:
            engine.grammars._thread = grammar_thread
            TIMES.clear()
            CALLS.clear()
            stats = engine.grammars.stats
            thread0, ahead0 = stats.thread_seconds, engine.num_steps_run_ahead
            start = time.perf_counter()
            outs = llm.generate([PROMPT] * args.num_requests, params, use_tqdm=False)
            wall = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            steps = max(CALLS["engine.step"], 1)
            print(f"\n## round {r + 1}: {name}: {tokens / wall:,.0f} tok/s, {steps} steps, "
                  f"{1e3 * wall / steps:.3f} ms a step, run ahead {engine.num_steps_run_ahead - ahead0}, "
                  f"grammar thread {1e3 * (stats.thread_seconds - thread0) / steps:.3f} ms a step")
            for key in sorted(TIMES, key=lambda k: -TIMES[k]):
                print(f"  {key:28s} {1e3 * TIMES[key] / steps:7.3f} ms/step  {CALLS[key] / steps:5.2f} calls/step")


if __name__ == "__main__":
    main()
