"""Data-parallel serving benchmark: the same workload through `pagedserve serve` with
--data-parallel-size 1 and then N, all requests at once under a concurrency cap (64 by default),
output tokens/s, TTFT and TPOT for each, and how the N replicas shared the work (prompt tokens,
prefix-cache hit rate per replica, from /v1/engine/state).

Two workloads: "random" prompts (nothing shared), and "shared_prefix" prompts whose first half is one
common text (a system prompt), where the router's prefix affinity decides how often the prefix cache
hits. On a 2-core CPU the replicas split the cores (each gets cores / N threads), so no speed-up is
expected there; on N GPUs each replica has its own.

    python bench/perf/dp_bench.py --serve-args "--device cpu"          # DP 1 vs 2
    python bench/perf/dp_bench.py --dp 1,2,4 --serve-args "--device cuda"
    python bench/perf/dp_bench.py --quick                               # CI size

Results: bench/results/<name>.json and .md (name: --name, default dp_<device>).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import signal
import sys
from pathlib import Path
from typing import Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.report import markdown_table, save  # noqa: E402
from serve_bench import WORDS, launch_server, make_prompts, run_rate, summarize  # noqa: E402

WORKLOADS = ("random", "shared_prefix")


async def workload_prompts(url: str, kind: str, num: int, input_len: int, seed: int) -> list[list[int]]:
    async with httpx.AsyncClient(timeout=60) as client:
        prompts = await make_prompts(client, url, num, input_len, seed)
        if kind == "random":
            return prompts
        rng = random.Random(seed + 1)
        text = " ".join(rng.choice(WORDS) for _ in range(input_len * 2))
        response = await client.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False})
        shared = response.json()["tokens"][:input_len // 2]
    return [shared + p[:input_len - len(shared)] for p in prompts]


async def replica_view(url: str) -> list[dict]:
    async with httpx.AsyncClient(timeout=60) as client:
        state = (await client.get(url + "/v1/engine/state")).json()
    replicas = state.get("replicas") or [{"replica": 0, "stats": state["stats"]}]
    return [{"replica": r["replica"], "prompt_tokens": r["stats"]["num_prompt_tokens_total"],
             "prefix_hit_rate": r["stats"]["prefix_hit_rate"]} for r in replicas]


async def run_one(url: str, args: argparse.Namespace, kind: str) -> dict:
    async with httpx.AsyncClient(timeout=60) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
    prompts = await workload_prompts(url, kind, args.num_prompts, args.input_len, args.seed)
    await run_rate(url, model, prompts[:2], 4, float("inf"), args.seed, None)  # warm-up
    before = await replica_view(url)
    results, duration = await run_rate(url, model, prompts, args.output_len, float("inf"), args.seed,
                                       args.concurrency)
    after = await replica_view(url)
    row = summarize(float("inf"), results, duration)
    row["replicas"] = [{"replica": a["replica"], "prompt_tokens": a["prompt_tokens"] - b["prompt_tokens"],
                        "prefix_hit_rate": a["prefix_hit_rate"]} for a, b in zip(after, before)]
    return row


def bench_dp(dp: int, args: argparse.Namespace) -> list[dict]:
    process, url = launch_server([*args.serve_args, "--data-parallel-size", str(dp), "--disable-log-requests"])
    try:
        with httpx.Client(timeout=60) as client:
            device = client.get(url + "/v1/engine/state").json().get("device")
        rows = []
        for kind in args.workloads:
            row = asyncio.run(run_one(url, args, kind))
            row.update(data_parallel_size=dp, workload=kind, device=device,
                       spread=" / ".join(str(r["prompt_tokens"]) for r in row["replicas"]))
            print(f"DP {dp} {kind}: {row['completed']} ok, {row['output_token_throughput']:.1f} out tok/s, "
                  f"TTFT p50 {row.get('p50_ttft_ms', 0):.0f} ms, prompt tokens per replica {row['spread']}",
                  flush=True)
            rows.append(row)
        return rows
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(120)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve-args", default="--device cpu", help="arguments for `pagedserve serve`, as one string")
    p.add_argument("--dp", default="1,2", help="data-parallel sizes to compare, comma-separated")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per request (ignore_eos)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="CI size: 16 prompts of 32 tokens, 8 out, 16 at once")
    p.add_argument("--name", default=None, help="results file name (default: dp_<device>)")
    p.add_argument("--out", type=Path, default=None, help="results directory (default: bench/results)")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.input_len, args.output_len, args.concurrency = 16, 32, 8, 16
    args.dp = [int(d) for d in args.dp.split(",")]
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workload(s) {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    args.serve_args = shlex.split(args.serve_args)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    rows = [row for dp in args.dp for row in bench_dp(dp, args)]
    device = (rows[0]["device"] or "unknown").split(" ")[0].split(":")[0]
    config = {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
              "concurrency": args.concurrency, "seed": args.seed, "serve_args": args.serve_args,
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "quick": args.quick}
    columns = ["data_parallel_size", "workload", "completed", "output_token_throughput", "request_throughput",
               "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "spread"]
    markdown = (f"Data-parallel serving on {rows[0]['device']}: {args.num_prompts} requests of {args.input_len} "
                f"prompt + {args.output_len} output tokens, {args.concurrency} in flight; spread = prompt tokens "
                f"each replica took.\n\n" + markdown_table(rows, columns))
    name = args.name or f"dp_{device}" + ("_quick" if args.quick else "")
    path = save(name, {"config": config, "results": rows}, markdown, args.out)
    print(markdown)
    print(f"saved {path}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
