"""preemption: a KV pool far smaller than the load, and the same answers.

The same greedy requests run twice: with a KV pool big enough for all of them
at once, and with a pool of a fraction of that (num_kv_blocks). The small pool
runs out of blocks as sequences grow; the scheduler preempts the most recently
admitted ones (their blocks are freed, their tokens kept) and recomputes them
when blocks return. Every request still completes, with token-identical
outputs (checked: demos.py exits with an error otherwise), at the cost of the recomputed tokens. float32 by default:
the two runs batch requests differently, and lower precision would let
rounding differences flip near-tied greedy choices.
"""

from __future__ import annotations

import math

import numpy as np
from common.report import markdown_table

from _demos.common import PromptMaker, add_engine_args, engine_label, make_llm, run_requests, token_ids, warm_up

BLOCK = 16


def add_arguments(ap) -> None:
    add_engine_args(ap)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=[32, 96], metavar=("MIN", "MAX"))
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--pool-fraction", type=float, default=0.3,
                    help="KV blocks given to the small pool, as a share of what the whole load needs at once")


def serve(args, prompts, params, num_kv_blocks=None) -> tuple[dict, list]:
    llm = make_llm(args, dtype=args.dtype or "float32", num_kv_blocks=num_kv_blocks,
                   max_num_seqs=len(prompts), max_model_len=args.prompt_tokens[1] + args.max_tokens + BLOCK)
    warm_up(llm)
    run = run_requests(llm, prompts, params, desc="small pool" if num_kv_blocks else "big pool")
    blocks = llm.llm_engine.stats()["num_blocks"]
    llm.shutdown()
    reasons = {c.finish_reason for o in run.outputs for c in o.outputs}
    running = [r.num_running for r in run.records]
    row = {"kv_pool_blocks": blocks, "peak_blocks_used": run.peak("num_used_blocks"),
           "mean_running": sum(running) / len(running), "preemptions": run.stats_delta["num_preemptions"],
           "recomputed_tokens": run.stats_delta["num_preempted_tokens"], "output_tokens": run.output_tokens,
           "completed": sum(o.finished for o in run.outputs), "finish_reasons": ",".join(sorted(map(str, reasons))),
           "wall_s": run.wall_s, "output_tok_s": run.output_tokens / run.wall_s}
    return row, token_ids(run.outputs)


def run(args) -> tuple[str, dict, str]:
    from pagedserve import SamplingParams
    if args.quick:
        args.num_requests, args.prompt_tokens, args.max_tokens = 6, [16, 32], 24
    rng = np.random.default_rng(0)
    lens = rng.integers(args.prompt_tokens[0], args.prompt_tokens[1] + 1, size=args.num_requests).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    need = sum(math.ceil((n + args.max_tokens) / BLOCK) for n in lens)
    longest = math.ceil((max(lens) + args.max_tokens) / BLOCK)
    small = max(longest + 1, int(need * args.pool_fraction))

    maker = PromptMaker(args)
    prompts = [maker.text(n, rng) for n in lens]
    big_row, want = serve(args, prompts, params)
    small_row, got = serve(args, prompts, params, num_kv_blocks=small)
    same = sum(a == b for a, b in zip(want, got))
    # Checked here, reported by demos.py after the results are saved (so a failed check still leaves its evidence).
    failures = [message for ok, message in (
        (small_row["completed"] == args.num_requests, "not every request completed in the small pool"),
        (small_row["preemptions"] > 0, "the small pool forced no preemption: lower --pool-fraction"),
        (same == args.num_requests, f"greedy outputs differ under preemption: {same} of {args.num_requests} equal"),
    ) if not ok]
    rows = [{"pool": "big (whole load fits)", **big_row},
            {"pool": f"small ({args.pool_fraction:.0%} of the load)", **small_row}]
    md = (f"## Demo: preemption under a small KV pool ({engine_label(args)})\n\n"
          f"{args.num_requests} requests, prompts {args.prompt_tokens[0]}..{args.prompt_tokens[1]} tokens, "
          f"{args.max_tokens} output tokens each, greedy (ignore_eos); the whole load needs {need} blocks at once.\n\n"
          f"{markdown_table(rows, list(rows[0]))}\n\n"
          + (f"**Checks failed**: {'; '.join(failures)}." if failures else
             f"All {args.num_requests} requests complete in the small pool with **token-identical outputs** "
             f"({same} of {args.num_requests}), after {small_row['preemptions']} preemptions and "
             f"{small_row['recomputed_tokens']} recomputed tokens."))
    return "demo_preemption", {"rows": rows, "same_outputs": same, "blocks_needed_at_once": need,
                               "failures": failures}, md
