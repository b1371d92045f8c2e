"""parallel-sampling: n = 4 samples of one prompt, forked with copy-on-write vs four requests.

With n = 4 the prompt is prefilled once; after it the sequence forks into four
that share the prompt's blocks (refcounts), and the partly filled last prompt
block is copied on the first write of each child (copy-on-write). Four
independent requests for the same prompt each hold their own copy of the
prompt's KV (with the prefix cache off), or share its full blocks through the
prefix cache (on) but compute the prompt four times when they arrive
together. Peak blocks are read from the scheduler after every schedule().
"""

from __future__ import annotations

import math

import numpy as np
from common.report import markdown_table

from _demos.common import PromptMaker, add_engine_args, engine_label, make_llm, run_requests, warm_up

N = 4
BLOCK = 16


def add_arguments(ap) -> None:
    add_engine_args(ap)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=64)


def measure(llm, args, forked: bool) -> dict:
    from pagedserve import SamplingParams
    caching = llm.llm_engine.scheduler.config.enable_prefix_caching
    prompt = PromptMaker(args).text(args.prompt_tokens, np.random.default_rng(0))
    if forked:
        run = run_requests(llm, [prompt], SamplingParams(n=N, temperature=0.8, seed=1, max_tokens=args.max_tokens,
                                                         ignore_eos=True), desc="n=4")
    else:
        run = run_requests(llm, [prompt] * N, [SamplingParams(temperature=0.8, seed=1 + i, max_tokens=args.max_tokens,
                                                              ignore_eos=True) for i in range(N)], desc="4 requests")
    samples = [c for o in run.outputs for c in o.outputs]
    assert len(samples) == N and all(len(c.token_ids) == args.max_tokens for c in samples)
    return {"setup": ("n=4, fork + copy-on-write" if forked else "4 independent requests") +
            (", prefix cache on" if caching else ", prefix cache off"),
            "peak_kv_blocks": run.peak("num_used_blocks"), "peak_blocks_shared": run.peak("blocks_saved_by_sharing"),
            "prompt_tokens_computed": len(prompt) * (1 if forked else N) - run.stats_delta["prefix_hit_blocks"] * BLOCK,
            "distinct_samples": len({tuple(c.token_ids) for c in samples}), "wall_s": run.wall_s}


def run(args) -> tuple[str, dict, str]:
    if args.quick:
        args.prompt_tokens, args.max_tokens = 40, 8
    rows = []
    for caching, runs in ((False, (False, True)), (True, (False,))):
        llm = make_llm(args, enable_prefix_caching=caching, max_num_seqs=8)
        warm_up(llm)
        rows += [measure(llm, args, forked) for forked in runs]
        llm.shutdown()
    rows = [rows[0], rows[2], rows[1]]  # independent (cache off, on), then forked
    p, o = args.prompt_tokens, args.max_tokens
    kv_len = p + o - 1  # the last sampled token is never written
    independent = N * math.ceil(kv_len / BLOCK)
    shared = p // BLOCK  # full prompt blocks every child shares
    forked = shared + N * (math.ceil(kv_len / BLOCK) - shared)
    for r in rows:
        r["blocks_vs_independent"] = r["peak_kv_blocks"] / rows[0]["peak_kv_blocks"]
    md = (f"## Demo: parallel sampling, n = {N} ({engine_label(args)})\n\n"
          f"One {p}-token prompt, {o} output tokens per sample (temperature 0.8, ignore_eos), block size {BLOCK}. "
          f"Expected peak: {independent} blocks for four private copies, {forked} with the fork "
          f"({shared} full prompt blocks shared, the rest private to each sample).\n\n"
          f"{markdown_table(rows, list(rows[0]))}\n\n"
          f"Fork + copy-on-write holds **{rows[2]['peak_kv_blocks']} blocks instead of {rows[0]['peak_kv_blocks']}** "
          "and computes the prompt once. With the prefix cache on, four independent requests that arrive together "
          "still each compute and hold the prompt: a block enters the cache only once it has been computed.")
    return "demo_parallel_sampling", {"rows": rows, "expected_independent_blocks": independent,
                                      "expected_forked_blocks": forked, "prompt_tokens": p, "max_tokens": o}, md
