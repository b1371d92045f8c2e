"""Sampler latency per step for typical batch mixes; saves JSON + markdown.

Usage:
    PYTHONPATH=python python bench/perf/bench_sampler.py --device cuda
    PYTHONPATH=python python bench/perf/bench_sampler.py --device cpu --quick

Each case builds one step's rows and logits once, then times whole sampler
calls (the call ends with its device-to-host copy, so wall time is the step's
sampling cost as the model runner sees it). Results go to
bench/results/sampler_<device>.{json,md} (sampler_<device>_quick with --quick).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.report import arg_parser, markdown_table, save  # noqa: E402

from pagedserve.sample.sampler import Sampler, SamplingRow  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402

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
    parser = arg_parser(__doc__, "small batches and vocab only")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per case (default 30, --quick: 5)")
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
    name = f"sampler_{device.type}" + ("_quick" if args.quick else "")
    md = (f"# Sampler latency per step\n\nRows carry {PROMPT_LEN} prompt and {OUTPUT_LEN} output tokens; "
          f"median of {iters} calls.\n\n"
          + markdown_table(results, ["vocab", "rows", "case", "median_ms", "min_ms", "p90_ms"]))
    path = save(name, {"device": args.device, "iters": iters, "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN,
                       "rows": results}, md, args.out)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
