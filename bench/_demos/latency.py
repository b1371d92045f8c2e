"""latency: per-request completion time, static batches vs continuous batching.

A queue of requests with mixed output lengths (short and long, seeded,
ignore_eos) arrives at once; at most 4 run together. Static batching takes the
queue 4 at a time and runs each batch to completion before starting the next:
a request's result comes back when its batch ends. Continuous batching
(max_num_seqs=4) starts the next request the step one finishes. Both run on the
same engine, one after the other, so per-step costs are the same and only the
scheduling differs. (Our static batches still drop finished rows, which makes
their steps cheaper than a padded static batch's: the comparison favours them.)
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from _demos.common import add_engine_args, engine_label, make_llm, run_requests, PromptMaker, warm_up
from _report import markdown_table

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


def static_batches(llm, prompts, params) -> tuple[list[float], float]:
    """Completion time of each request (its batch's end) from the queue's start."""
    done: list[float] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), MAX_RUNNING):
        run_requests(llm, prompts[i:i + MAX_RUNNING], params[i:i + MAX_RUNNING], desc=f"static batch {i // 4}")
        done += [time.perf_counter() - start] * len(prompts[i:i + MAX_RUNNING])
    return done, time.perf_counter() - start


def summary(times: list[float]) -> dict:
    return {"mean_s": statistics.mean(times), "p50_s": float(np.percentile(times, 50)),
            "p90_s": float(np.percentile(times, 90)), "max_s": max(times)}


def run(args) -> tuple[str, dict, str]:
    if args.quick:
        args.num_requests, args.short, args.long = 8, [2, 4], [12, 20]
    llm = make_llm(args, max_num_seqs=MAX_RUNNING)
    warm_up(llm)
    prompts, params, lens = workload(args)
    static_done, static_wall = static_batches(llm, prompts, params)
    cont = run_requests(llm, prompts, params, desc="continuous")
    llm.shutdown()
    cont_done = [o.metrics.finished_time - o.metrics.arrival_time for o in cont.outputs]
    rows = [{"request": i, "prompt_tokens": len(p), "output_tokens": n, "batch": i // MAX_RUNNING,
             "static_s": s, "continuous_s": c, "speedup": s / c}
            for i, (p, n, s, c) in enumerate(zip(prompts, lens, static_done, cont_done))]
    st, ct = summary(static_done), summary(cont_done)
    totals = [{"schedule": "static batches of 4", **st, "tok_s": sum(lens) / static_wall},
              {"schedule": "continuous, max 4 running", **ct, "tok_s": cont.output_tokens / cont.wall_s}]
    md = (f"## Demo: completion time, static vs continuous batching ({engine_label(args)})\n\n"
          f"{len(lens)} requests queued at once, outputs {args.short[0]}..{args.short[1]} or "
          f"{args.long[0]}..{args.long[1]} tokens (ignore_eos), at most {MAX_RUNNING} running. Completion time "
          "from the queue's start; a static batch returns when its longest request ends.\n\n"
          f"{markdown_table(rows, list(rows[0]))}\n\n{markdown_table(totals, list(totals[0]))}\n\n"
          f"Mean completion time: static {st['mean_s']:.2f} s, continuous {ct['mean_s']:.2f} s "
          f"(**{st['mean_s'] / ct['mean_s']:.2f}x** sooner).")
    return "demo_latency", {"rows": rows, "totals": totals, "max_running": MAX_RUNNING}, md
