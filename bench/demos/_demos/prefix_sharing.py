"""prefix-sharing: many requests behind one long system prompt, prefix cache on and off.

Every request is the same system prompt followed by its own short question.
Two engines, one with enable_prefix_caching and one without, each serve the
requests one after another (a request arrives once the previous one is
answered; time to first token is then prefill time alone), then a burst with a
fresh system prompt: one request, then all the others at once (KV blocks held
at the peak; with the cache they all map the system prompt to the same blocks).
"""

from __future__ import annotations

import statistics

import numpy as np
from common.report import markdown_table

from _demos.common import PromptMaker, add_engine_args, engine_label, make_llm, run_requests, token_ids, warm_up


def add_arguments(ap) -> None:
    add_engine_args(ap)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=8)


def ttft(run) -> list[float]:
    return [o.metrics.first_token_time - o.metrics.arrival_time for o in run.outputs]


def make_prompts(args, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    maker = PromptMaker(args)
    system = maker.text(args.system_tokens, rng)
    return [system + maker.text(int(rng.integers(12, 25)), rng) for _ in range(args.num_requests)]


def serve(args, caching: bool) -> dict:
    from pagedserve import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm = make_llm(args, enable_prefix_caching=caching, max_num_seqs=max(8, args.num_requests))
    warm_up(llm)
    one_by_one = [run_requests(llm, [p], params, desc="one by one") for p in make_prompts(args, seed=0)]
    # A fresh system prompt for the burst: one request brings it first, then the rest arrive together.
    burst = make_prompts(args, seed=1)
    run_requests(llm, burst[:1], params, desc="burst lead")
    together = run_requests(llm, burst[1:], params, desc="all at once")
    llm.shutdown()
    times = [t for r in one_by_one for t in ttft(r)]
    queried = sum(r.stats_delta["prefix_queried_blocks"] for r in one_by_one)
    hits = sum(r.stats_delta["prefix_hit_blocks"] for r in one_by_one)
    q2, h2 = together.stats_delta["prefix_queried_blocks"], together.stats_delta["prefix_hit_blocks"]
    return {
        "prefix_cache": "on" if caching else "off",
        "ttft_first_ms": times[0] * 1e3, "ttft_mean_rest_ms": statistics.mean(times[1:]) * 1e3,
        "hit_rate_one_by_one": hits / queried if queried else 0.0,
        "hit_rate_all_at_once": h2 / q2 if q2 else 0.0,
        "peak_blocks_all_at_once": together.peak("num_used_blocks"),
        "wall_all_at_once_s": together.wall_s,
        "mean_ttft_all_at_once_ms": statistics.mean(ttft(together)) * 1e3,
        "_outputs": token_ids([o for r in one_by_one for o in r.outputs]) + token_ids(together.outputs),
    }


def run(args) -> tuple[str, dict, str]:
    if args.quick:
        args.num_requests, args.system_tokens, args.max_tokens = 4, 64, 2
    rows = [serve(args, caching) for caching in (False, True)]
    without, with_cache = rows[0].pop("_outputs"), rows[1].pop("_outputs")
    same = sum(a == b for a, b in zip(without, with_cache))
    off, on = rows
    shared_blocks = args.system_tokens // 16
    saved = off["peak_blocks_all_at_once"] - on["peak_blocks_all_at_once"]
    md = (f"## Demo: prefix sharing ({engine_label(args)})\n\n"
          f"{args.num_requests} requests: one {args.system_tokens}-token system prompt + a 12..24-token question "
          f"each, {args.max_tokens} output tokens, greedy. One after another (ttft_first: the first request, "
          "which fills the cache; ttft_mean_rest: the others), then a burst with a fresh system prompt: one "
          f"request, then the other {args.num_requests - 1} at once.\n\n"
          f"{markdown_table(rows, list(rows[0]))}\n\n"
          f"Time to first token after the first request: {off['ttft_mean_rest_ms']:.1f} ms without the cache, "
          f"{on['ttft_mean_rest_ms']:.1f} ms with it (**{off['ttft_mean_rest_ms'] / on['ttft_mean_rest_ms']:.1f}x**)."
          f" Burst: **{saved} KV blocks saved** at the peak ({off['peak_blocks_all_at_once']} -> "
          f"{on['peak_blocks_all_at_once']}; {shared_blocks} full system-prompt blocks x "
          f"{args.num_requests - 2} requests beyond the one holding them = {shared_blocks * (args.num_requests - 2)}"
          f" if all run together). Greedy outputs equal with and without the cache: {same} of {len(without)}.")
    return "demo_prefix_sharing", {"rows": rows, "same_outputs": same, "num_outputs": len(without),
                                   "blocks_saved_burst": saved, "num_requests": args.num_requests,
                                   "system_tokens": args.system_tokens}, md
