"""Sampler latency per step for typical batch mixes; saves JSON + markdown.

Usage:
    PYTHONPATH=python python bench/bench_sampler.py --device cuda
    PYTHONPATH=python python bench/bench_sampler.py --device cpu --quick

Each case builds one step's rows and logits once, then times whole sampler
calls (the call ends with its device-to-host copy, so wall time is the step's
sampling cost as the model runner sees it). Results go to
bench/results/sampler_<device>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from pagedserve.sampler import Sampler, SamplingRow
from pagedserve.sampling_params import SamplingParams

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PROMPT_LEN, OUTPUT_LEN = 512, 128


def case_params() -> dict[str, Callable[[int], SamplingParams]]:
    """Name -> params for row i (a few cases mix settings across rows)."""
    return {
        "greedy (fast path)": lambda i: SamplingParams(temperature=0.0),
        "temperature": lambda i: SamplingParams(temperature=0.8),
        "top_k=50": lambda i: SamplingParams(temperature=0.8, top_k=50),
        "top_k+top_p": lambda i: SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
        "min_p": lambda i: SamplingParams(temperature=0.8, min_p=0.05),
        "penalties+top_p": lambda i: SamplingParams(temperature=0.8, top_p=0.9,
                                                    repetition_penalty=1.1,
                                                    frequency_penalty=0.3, presence_penalty=0.2),
        "logprobs=5": lambda i: SamplingParams(temperature=0.8, logprobs=5),
        "seeded rows": lambda i: SamplingParams(temperature=0.8, seed=i),
        "mixed": lambda i: [SamplingParams(temperature=0.0),
                            SamplingParams(temperature=0.7, top_p=0.9),
                            SamplingParams(temperature=1.0, top_k=20, repetition_penalty=1.2),
                            SamplingParams(temperature=0.9, logprobs=2, seed=i)][i % 4],
    }


def build_rows(sampler: Sampler, make_params: Callable[[int], SamplingParams], num_rows: int,
               vocab: int) -> list[SamplingRow]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(num_rows):
        params = make_params(i)
        prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist()
        output = torch.randint(0, vocab, (OUTPUT_LEN,), generator=gen).tolist()
        rows.append(SamplingRow(params, 1, prompt, output, sampler.generator_for(params)))
    return rows


def time_case(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], device: torch.device,
              warmup: int, iters: int) -> dict[str, float]:
    for _ in range(warmup):
        sampler(logits, rows)
    samples_ms = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        sampler(logits, rows)
        samples_ms.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": statistics.median(samples_ms), "min_ms": min(samples_ms),
            "p90_ms": sorted(samples_ms)[int(0.9 * (len(samples_ms) - 1))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small batches and vocab only")
    parser.add_argument("--iters", type=int, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    rows_list = [1, 16] if args.quick else [1, 16, 64, 256]
    vocabs = [49152] if args.quick else [49152, 128256]
    iters = args.iters or (5 if args.quick else 30)

    results = []
    for vocab in vocabs:
        sampler = Sampler(device, vocab, eos_token_ids=[0], seed=0)
        for num_rows in rows_list:
            logits = torch.randn(num_rows, vocab, device=device) * 3
            for name, make_params in case_params().items():
                rows = build_rows(sampler, make_params, num_rows, vocab)
                timing = time_case(sampler, logits, rows, device, warmup=2, iters=iters)
                results.append({"case": name, "rows": num_rows, "vocab": vocab, **timing})
                print(f"vocab={vocab:>6} rows={num_rows:>3} {name:<20} "
                      f"median {timing['median_ms']:8.3f} ms  min {timing['min_ms']:8.3f} ms",
                      flush=True)
    save(results, device, iters)


def save(results: list[dict], device: torch.device, iters: int) -> None:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    name = device.type
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else
            platform.processor() or platform.machine(),
            "torch": torch.__version__, "iters": iters,
            "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN}
    (RESULTS_DIR / f"sampler_{name}.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=2))
    lines = [f"# Sampler latency per step ({meta['device']}, torch {meta['torch']})", "",
             f"Rows carry {PROMPT_LEN} prompt and {OUTPUT_LEN} output tokens; "
             f"median of {iters} calls.", "",
             "| vocab | rows | case | median ms | min ms | p90 ms |",
             "| ---: | ---: | --- | ---: | ---: | ---: |"]
    lines += [f"| {r['vocab']} | {r['rows']} | {r['case']} | {r['median_ms']:.3f} | "
              f"{r['min_ms']:.3f} | {r['p90_ms']:.3f} |" for r in results]
    (RESULTS_DIR / f"sampler_{name}.md").write_text("\n".join(lines) + "\n")
    print(f"saved {RESULTS_DIR}/sampler_{name}.json and .md")


if __name__ == "__main__":
    main()
