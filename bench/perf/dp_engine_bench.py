"""Data parallelism without HTTP: the engine the server drives (one LLMEngine, or DataParallelEngine's N
replica processes behind one router), fed all requests at once and stepped until every one is done.

dp_bench.py measures the same through `pagedserve serve` and a streaming client; past tens of thousands
of tokens per second one Python client (and the server's one API process) parse every streamed token
and become the limit, so this script isolates what the replicas themselves deliver: output tokens per
second of wall time, DP = N against DP = 1, with the same requests (random prompts, ignore_eos) and the
same number of requests in flight in all (--concurrency; each of N replicas runs at most 1/N of them).

    python bench/perf/dp_engine_bench.py --shape tinyllama-1.1b --dp 1 2 --concurrency 256   (GPUs: one per replica)
    python bench/perf/dp_engine_bench.py --quick                                              # CPU, tiny
Results: bench/results/dp_engine_<device>_<shape>.json and .md.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.model_shapes import shape_dir  # noqa: E402
from common.report import arg_parser, markdown_table, save  # noqa: E402
from perf.throughput import prompts_for  # noqa: E402


def make_engine(args, model_dir: Path, load_format: str, dp: int):
    from pagedserve import LLMEngine
    from pagedserve.engine.data_parallel.client import DataParallelEngine
    from pagedserve.engine_config import EngineConfig

    config = EngineConfig(model=str(model_dir), load_format=load_format, device=args.device, dtype=args.dtype,
                          max_num_seqs=args.concurrency // dp, max_model_len=args.prompt_len + args.output_len + 16,
                          data_parallel_size=dp)
    return LLMEngine(config) if dp == 1 else DataParallelEngine(config)


def drain(engine, ids: set[str]) -> None:
    """Steps until every request in ids has finished."""
    while ids:
        for out in engine.step():
            if out.finished:
                ids.discard(out.request_id)


def submit(engine, prompts: list[list[int]], output_len: int, tag: str) -> set[str]:
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ids = set()
    for i, prompt in enumerate(prompts):
        ids.add(f"{tag}-{i}")
        engine.add_request(f"{tag}-{i}", {"prompt": None, "prompt_token_ids": prompt}, params)
    return ids


def measure(args, model_dir: Path, load_format: str, dp: int, prompts: list[list[int]]) -> dict:
    engine = make_engine(args, model_dir, load_format, dp)
    try:
        drain(engine, submit(engine, prompts[:2 * dp], 8, "warm"))  # every replica's first steps and graphs
        start = time.perf_counter()
        drain(engine, submit(engine, prompts, args.output_len, "run"))
        wall = time.perf_counter() - start
    finally:
        engine.shutdown()
    tokens = len(prompts) * args.output_len
    return {"data_parallel_size": dp, "requests": len(prompts), "output_tokens": tokens, "wall_s": wall,
            "output_tok_s": tokens / wall}


def main() -> None:
    ap = arg_parser(__doc__, "CPU, default model, DP 1 and 2, 8 requests of 16 + 8 tokens")
    ap.add_argument("--shape", default="default", help="'default' (SmolLM2-135M) or a dummy shape")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--concurrency", type=int, default=256, help="requests in flight in all (split over the replicas)")
    ap.add_argument("--requests-per-slot", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    args = ap.parse_args()
    if args.quick:
        args.device, args.concurrency, args.requests_per_slot, args.prompt_len, args.output_len = "cpu", 8, 1, 16, 8
    if args.shape == "default":
        from pagedserve.models.default_model import default_model_dir
        model_dir, load_format = default_model_dir(), "auto"
    else:
        model_dir, load_format = shape_dir(args.shape), "dummy"
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = prompts_for(args.concurrency * args.requests_per_slot, args.prompt_len, vocab)
    rows = [measure(args, model_dir, load_format, dp, prompts) for dp in args.dp]
    for row in rows:
        row["x_vs_dp1"] = row["output_tok_s"] / rows[0]["output_tok_s"]
    table = markdown_table(rows, list(rows[0]))
    print(table)
    name = f"dp_engine_{args.device.split(':')[0]}_{args.shape}".replace(".", "_") + ("_quick" if args.quick else "")
    save(name, {"shape": args.shape, "device": args.device, "concurrency": args.concurrency,
                "prompt_len": args.prompt_len, "output_len": args.output_len, "rows": rows},
         f"## Data parallel, engine only ({args.shape}, {args.device}): {len(prompts)} requests of "
         f"{args.prompt_len} + {args.output_len} tokens, {args.concurrency} in flight in all\n\n" + table,
         args.out)


if __name__ == "__main__":
    main()
