"""Serving benchmark, in the manner of vLLM's benchmark_serving: requests with
random prompts (fixed seed) arrive as a Poisson process at several rates
against a running OpenAI-compatible server and stream their outputs; reports
throughput and TTFT / TPOT / ITL / end-to-end latency at p50 / p90 / p99.

    python bench/perf/serve_bench.py http://127.0.0.1:8000            # a running server
    python bench/perf/serve_bench.py --launch --serve-args "--device cpu"   # start a server for the run
    python bench/perf/serve_bench.py --launch --quick                 # CI-sized run

Results: bench/results/<name>.json and .md (name: --name, default serve_<device>).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.report import markdown_table, save  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PERCENTILES = (50, 90, 99)
# Words random prompts are drawn from; prompts are then cut to the exact token count.
WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river mountain engine cache block token batch paper "
         "light music garden window history science market energy island signal ocean forest letter").split()


@dataclass
class RequestResult:
    prompt_len: int
    ok: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> Optional[float]:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


# ---------------------------------------------------------------------------- workload
async def make_prompts(client: httpx.AsyncClient, url: str, num: int, input_len: int, seed: int) -> list[list[int]]:
    """`num` token-id prompts of exactly `input_len` tokens, the same for a given seed."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        text = " ".join(rng.choice(WORDS) for _ in range(input_len * 2))
        response = await client.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False})
        response.raise_for_status()
        prompts.append(response.json()["tokens"][:input_len])
    return prompts


def arrival_gaps(num: int, rate: float, seed: int) -> list[float]:
    """Seconds between arrivals of a Poisson process of `rate` requests/s (all at once for inf)."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(num)]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                      output_len: int) -> RequestResult:
    result = RequestResult(prompt_len=len(prompt))
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.ok = result.output_tokens > 0
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        result.error = f"{type(err).__name__}: {err}"
    return result


async def run_rate(url: str, model: str, prompts: list[list[int]], output_len: int, rate: float, seed: int,
                   max_concurrency: Optional[int]) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=max(len(prompts), 1), max_keepalive_connections=0)
    gate = asyncio.Semaphore(max_concurrency or len(prompts))
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600), limits=limits, headers=_auth_headers()) as client:
        async def gated(prompt):
            async with gate:
                return await one_request(client, url, model, prompt, output_len)
        tasks = []
        start = time.perf_counter()
        for prompt, gap in zip(prompts, arrival_gaps(len(prompts), rate, seed), strict=True):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(gated(prompt)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


# ---------------------------------------------------------------------------- reporting
def percentiles(values: list[float], name: str, scale: float = 1000.0) -> dict:
    """mean and p50/p90/p99 of `values` (seconds), in milliseconds."""
    if not values:
        return {}
    ordered = sorted(values)
    out = {f"mean_{name}_ms": statistics.fmean(ordered) * scale}
    for p in PERCENTILES:
        index = min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))
        out[f"p{p}_{name}_ms"] = ordered[index] * scale
    return out


def summarize(rate: float, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    row = {"request_rate": "inf" if math.isinf(rate) else rate, "completed": len(ok),
           "failed": len(results) - len(ok),
           "duration_s": duration, "request_throughput": len(ok) / duration,
           "output_token_throughput": out_tokens / duration,
           "total_token_throughput": (in_tokens + out_tokens) / duration,
           "total_input_tokens": in_tokens, "total_output_tokens": out_tokens}
    row.update(percentiles([r.ttft for r in ok], "ttft"))
    row.update(percentiles([r.tpot for r in ok if r.tpot is not None], "tpot"))
    row.update(percentiles([gap for r in ok for gap in r.itls], "itl"))
    row.update(percentiles([r.latency for r in ok], "e2el"))
    errors = sorted({r.error for r in results if r.error})
    if errors:
        row["errors"] = errors[:5]
    return row


def _auth_headers() -> dict:
    key = os.environ.get("PAGEDSERVE_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


# ---------------------------------------------------------------------------- server
def launch_server(serve_args: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *serve_args]
    env = dict(os.environ)
    import pagedserve
    source = str(Path(pagedserve.__file__).resolve().parents[1])
    if source == str(ROOT / "python"):  # running from the tree (a dev build): so does the server
        env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH")) if p)
    process = subprocess.Popen(cmd, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit("the server did not become healthy")


async def bench(args: argparse.Namespace, url: str) -> dict:
    async with httpx.AsyncClient(timeout=60, headers=_auth_headers()) as client:
        model = args.model or (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        state = (await client.get(url + "/v1/engine/state")).json()
        prompts = await make_prompts(client, url, args.num_prompts, args.input_len, args.seed)
    await run_rate(url, model, prompts[:2], 4, math.inf, args.seed, None)  # warm-up
    rows = []
    for rate in args.rates:
        results, duration = await run_rate(url, model, prompts, args.output_len, rate, args.seed,
                                           args.max_concurrency)
        row = summarize(rate, results, duration)
        rows.append(row)
        print(f"rate {row['request_rate']}: {row['completed']} ok, {row['output_token_throughput']:.1f} out tok/s, "
              f"TTFT p50 {row.get('p50_ttft_ms', 0):.0f} ms, TPOT p50 {row.get('p50_tpot_ms', 0):.1f} ms",
              flush=True)
    server = {"model": model, "device": state.get("device"), "max_model_len": state.get("max_model_len"),
              "num_kv_blocks": state.get("stats", {}).get("num_blocks")}
    config = {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
              "rates": ["inf" if math.isinf(r) else r for r in args.rates], "seed": args.seed,
              "max_concurrency": args.max_concurrency, "serve_args": args.serve_args if args.launch else None,
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    return {"server": server, "config": config, "results": rows}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url", nargs="?", help="server base URL, e.g. http://127.0.0.1:8000 (or use --launch)")
    p.add_argument("--launch", action="store_true", help="start `pagedserve serve` for the run")
    p.add_argument("--serve-args", default="", help="arguments for the launched `pagedserve serve`, as one string")
    p.add_argument("--rates", default="1,2,4,8,inf", help="request rates (req/s), comma-separated; inf = all at once")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per request (ignore_eos)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--model", default=None, help="model name (default: the server's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="CI size: 8 prompts of 32 tokens, 16 out, rates 2,inf")
    p.add_argument("--name", default=None, help="results file name (default: serve_<device>)")
    p.add_argument("--out", type=Path, default=None, help="results directory (default: bench/results)")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.input_len, args.output_len, args.rates = 8, 32, 16, "2,inf"
    args.rates = [float(r) for r in args.rates.split(",")]
    args.serve_args = shlex.split(args.serve_args)
    if not args.url and not args.launch:
        p.error("give a server URL or --launch")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    process, url = launch_server(args.serve_args) if args.launch else (None, args.url.rstrip("/"))
    try:
        payload = asyncio.run(bench(args, url))
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
    columns = ["request_rate", "completed", "request_throughput", "output_token_throughput", "p50_ttft_ms",
               "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p90_itl_ms", "p99_itl_ms", "p50_e2el_ms"]
    s = payload["server"]
    markdown = (f"Serving benchmark: {s['model']} on {s['device']}, {args.num_prompts} requests of "
                f"{args.input_len} prompt + {args.output_len} output tokens, Poisson arrivals.\n\n"
                + markdown_table(payload["results"], columns))
    name = args.name or f"serve_{(s['device'] or 'unknown').split(':')[0]}"
    path = save(name, payload, markdown, args.out)
    print(markdown)
    print(f"saved {path}")
    return 0 if all(r["failed"] == 0 for r in payload["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
