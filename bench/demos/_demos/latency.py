"""latency: per-request completion time, static batches vs continuous batching.

A queue of requests with mixed output lengths (short and long, seeded,
ignore_eos) arrives at once; at most 4 run together. Static batching takes the
queue 4 at a time and runs each batch to completion before starting the next:
a request's result comes back when its batch ends. Continuous batching
(max_num_seqs=4) starts the next request the step one finishes. Both run on the
same engine, one after the other, so per-step costs are the same and only the
scheduling differs. (Our static batches still drop finished rows, which makes
their steps cheaper than a padded static batch's: the comparison favours them.)
Completion is counted in engine steps, which the schedule alone decides, and
in seconds, which a shared machine's other work also moves.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
from common.report import markdown_table

from _demos.common import PromptMaker, add_engine_args, engine_label, make_llm, run_requests, warm_up

MAX_RUNNING = 4


def add_arguments(ap) -> None:
    add_engine_args(ap)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--short", type=int, nargs=2, default=[8, 16], metavar=("MIN", "MAX"))
    ap.add_argument("--long", type=int, nargs=2, default=[96, 160], metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=0)


def workload(args):
    from pagedserve import SamplingParams
    rng = np.random.default_rng(args.seed)
    long_mask = rng.random(args.num_requests) < 0.35
    lens = [int(rng.integers(lo, hi + 1)) for lo, hi in (args.long if m else args.short for m in long_mask)]
    maker = PromptMaker(args)
    prompts = [maker.text(int(rng.integers(16, 65)), rng) for _ in lens]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
    return prompts, params, lens


def static_batches(llm, prompts, params) -> tuple[list[int], list[float], float]:
    """Completion of each request (its batch's end) from the queue's start, in engine steps and seconds."""
    steps_done, seconds_done, steps = [], [], 0
    start = time.perf_counter()
    for i in range(0, len(prompts), MAX_RUNNING):
        batch = run_requests(llm, prompts[i:i + MAX_RUNNING], params[i:i + MAX_RUNNING], desc=f"static batch {i // 4}")
        steps += len(batch.records)
        steps_done += [steps] * len(batch.outputs)
        seconds_done += [time.perf_counter() - start] * len(batch.outputs)
    return steps_done, seconds_done, time.perf_counter() - start


def summary(values: list[float], unit: str) -> dict:
    return {f"mean_{unit}": statistics.mean(values), f"p50_{unit}": float(np.percentile(values, 50)),
            f"p90_{unit}": float(np.percentile(values, 90)), f"max_{unit}": max(values)}


def run(args) -> tuple[str, dict, str]:
    if args.quick:
        args.num_requests, args.short, args.long = 8, [2, 4], [12, 20]
    llm = make_llm(args, max_num_seqs=MAX_RUNNING)
    warm_up(llm)
    prompts, params, lens = workload(args)
    static_steps, static_s, static_wall = static_batches(llm, prompts, params)
    cont = run_requests(llm, prompts, params, desc="continuous")
    llm.shutdown()
    cont_s = [o.metrics.finished_time - o.metrics.arrival_time for o in cont.outputs]
    rows = [{"request": i, "prompt_tokens": len(p), "output_tokens": n, "batch": i // MAX_RUNNING,
             "static_steps": ss, "continuous_steps": cs, "static_s": st, "continuous_s": ct}
            for i, (p, n, ss, cs, st, ct) in enumerate(zip(prompts, lens, static_steps, cont.finish_steps,
                                                           static_s, cont_s))]
    totals = [{"schedule": "static batches of 4", **summary(static_steps, "steps"), **summary(static_s, "s"),
               "tok_s": sum(lens) / static_wall},
              {"schedule": "continuous, max 4 running", **summary(cont.finish_steps, "steps"), **summary(cont_s, "s"),
               "tok_s": cont.output_tokens / cont.wall_s}]
    st, ct = totals
    cols = ["schedule", "mean_steps", "p50_steps", "p90_steps", "max_steps", "mean_s", "p90_s", "max_s", "tok_s"]
    md = (f"## Demo: completion time, static vs continuous batching ({engine_label(args)})\n\n"
          f"{len(lens)} requests queued at once, outputs {args.short[0]}..{args.short[1]} or "
          f"{args.long[0]}..{args.long[1]} tokens (ignore_eos), at most {MAX_RUNNING} running, on one engine. "
          "Completion from the queue's start, in engine steps (exact: what the schedule decides) and in seconds "
          "(measured, so also what else the machine was doing); a static batch returns when its longest request "
          "ends.\n\n"
          f"{markdown_table(rows, list(rows[0]))}\n\n{markdown_table(totals, cols)}\n\n"
          f"Mean completion: static {st['mean_steps']:.0f} steps, continuous {ct['mean_steps']:.0f} steps "
          f"(**{st['mean_steps'] / ct['mean_steps']:.2f}x** sooner); all done after {st['max_steps']} vs "
          f"{ct['max_steps']} steps. Measured: {st['mean_s']:.2f} s vs {ct['mean_s']:.2f} s mean.")
    return "demo_latency", {"rows": rows, "totals": totals, "max_running": MAX_RUNNING}, md
