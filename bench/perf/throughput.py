"""Output throughput vs concurrency: pagedserve against transformers, same run.

For each concurrency C, C requests (random prompt token ids, PROMPT_LEN long)
each generate OUTPUT_LEN tokens with ignore_eos — or, with --min-output-len,
a length drawn uniformly from [MIN, OUTPUT_LEN] per request, as real requests
finish at different times. Reported per engine: useful output tokens per second
over the wall time, mean time per output token of a request, and peak GPU
memory (pagedserve's includes its KV pool, sized once from
--gpu-memory-utilization; the KV it actually held at the peak is reported
beside it). transformers runs (a) one request at a time — its rate does not depend
on C, so a sample of requests measures it — and (b) one statically padded batch
of C, which must run until its longest request is done: tokens generated past a
request's own length are waste and do not count.

    python bench/perf/throughput.py --device cpu --concurrency 1 4 16          # the CPU issue's figure
    python bench/perf/throughput.py --device cuda --shape tinyllama-1.1b --plot   # 1, 4, 16, 32, 64, 128, 256
    python bench/perf/throughput.py --device cuda --plot                            # SmolLM2-135M, real weights
    python bench/perf/throughput.py --quick                                    # CI: checks the script runs
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.model_shapes import load_hf, shape_dir  # noqa: E402
from common.plots import draw_throughput, pyplot  # noqa: E402
from common.report import add_engine_options, engine_options, markdown_table, save  # noqa: E402

GPU_CONCURRENCY = [1, 4, 16, 32, 64, 128, 256]
CPU_CONCURRENCY = [1, 4, 16]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--shape", default=None, help="dummy-weight model shape (bench/common/model_shapes.py)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None,
                    help=f"default: {' '.join(map(str, GPU_CONCURRENCY))} on CUDA, "
                         f"{' '.join(map(str, CPU_CONCURRENCY))} on CPU")
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=150)
    ap.add_argument("--min-output-len", type=int, default=None,
                    help="draw each request's output length uniformly from [MIN, --output-len]")
    ap.add_argument("--requests-per-slot", type=int, default=1,
                    help="K: C*K requests are served C at a time (pagedserve refills finished slots at once; "
                         "transformers runs K static batches of C back to back)")
    ap.add_argument("--hf-sequential-requests", type=int, default=2, help="sample size for transformers one-by-one")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    ap.add_argument("--hf-static-max", type=int, default=256, help="largest static batch given to transformers")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="pagedserve's max_model_len (default: prompt + output + 16; 0: the model's own)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks (one GPU each) for pagedserve")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="pagedserve's share of the card")
    ap.add_argument("--shape-warmup", action="store_true",
                    help="before each C, run C requests of the measured prompt length for 2 tokens, so that the "
                         "timed run finds the library kernels of its prefill shapes loaded (the default warm-up, "
                         "2 prompts, leaves a new shape's first use in the figure: ~25-35 ms at C=1 on an H200)")
    add_engine_options(ap)
    ap.add_argument("--name", default=None, help="results file name (default derived from device and model)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks that the script works")
    ap.add_argument("--plot", action="store_true", help="also save a PNG of tok/s vs concurrency")
    args = ap.parse_args()
    if args.concurrency is None:
        args.concurrency = GPU_CONCURRENCY if args.device.startswith("cuda") else CPU_CONCURRENCY
    if args.quick:
        args.concurrency, args.output_len, args.prompt_len, args.hf_sequential_requests = [1, 4], 8, 8, 1
    return args


def prompts_for(n: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, min(vocab, 30000), size=(n, prompt_len)).tolist()


def output_lens(args, n: int, seed: int = 1) -> list[int]:
    if args.min_output_len is None:
        return [args.output_len] * n
    return np.random.default_rng(seed).integers(args.min_output_len, args.output_len + 1, size=n).tolist()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


class PeakBlocks:
    """Stands in for the engine's scheduler to note the most KV blocks held right after a
    schedule() (one O(1) read per step)."""

    def __init__(self, scheduler):
        self._scheduler = scheduler
        self.peak = 0

    def schedule(self):
        step = self._scheduler.schedule()
        self.peak = max(self.peak, self._scheduler.pool.num_used)
        return step

    def __getattr__(self, name):
        return getattr(self._scheduler, name)


def make_llm(args, model_dir: Path, load_format: str, dtype: str, max_seqs: int):
    from pagedserve import LLM, SamplingParams
    llm = LLM(str(model_dir), dtype=dtype, device=args.device, load_format=load_format, max_num_seqs=max_seqs,
              max_model_len=(args.prompt_len + args.output_len + 16 if args.max_model_len is None
                             else args.max_model_len or None),
              gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tensor_parallel_size,
              **engine_options(args.option))
    vocab = llm.llm_engine.model_config.vocab_size
    llm.generate([{"prompt_token_ids": p} for p in prompts_for(2, args.prompt_len, vocab, seed=99)],
                 SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm up
    return llm, vocab


def run_pagedserve(args, model_dir: Path, load_format: str, dtype: str) -> tuple[list[dict], int]:
    from pagedserve import SamplingParams
    queued = args.requests_per_slot > 1  # the batch limit must be C itself: one engine per C
    llm = None if queued else make_llm(args, model_dir, load_format, dtype,
                                       args.max_num_seqs or max(args.concurrency))[0]
    rows = []
    for c in tqdm(args.concurrency, desc="pagedserve", dynamic_ncols=True):
        if queued:
            if llm is not None:
                llm.shutdown()
            llm, _ = make_llm(args, model_dir, load_format, dtype, c)
        vocab = llm.llm_engine.model_config.vocab_size
        n = c * args.requests_per_slot
        prompts = [{"prompt_token_ids": p} for p in prompts_for(n, args.prompt_len, vocab)]
        params = [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True) for k in output_lens(args, n)]
        if args.shape_warmup:
            llm.generate([{"prompt_token_ids": p} for p in prompts_for(n, args.prompt_len, vocab, seed=98)],
                         SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        engine = llm.llm_engine
        engine.scheduler = recorder = PeakBlocks(engine.scheduler)
        reset_peak(args.device)
        sync(args.device)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync(args.device)
        wall = time.perf_counter() - start
        engine.scheduler = recorder._scheduler
        plan = engine.worker.kv_plan
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        tpot = statistics.mean((o.metrics.last_token_time - o.metrics.first_token_time) /
                               max(1, len(o.outputs[0].token_ids) - 1) for o in outs)
        rows.append({"engine": "pagedserve", "concurrency": c, "output_tok_s": tokens / wall,
                     "ms_per_output_token": tpot * 1e3, "wall_s": wall, "peak_gpu_gib": peak_gib(args.device),
                     "kv_pool_gib": plan.num_bytes / 2**30,
                     "kv_peak_used_gib": recorder.peak * plan.bytes_per_block / 2**30})
        tqdm.write(f"pagedserve      C={c:4d}: {tokens / wall:10.1f} tok/s")
    llm.shutdown()
    gc.collect()
    return rows, vocab


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], output_len: int, device: str) -> float:
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding needed
    sync(device)
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len, min_new_tokens=output_len,
                   do_sample=False, pad_token_id=0)
    sync(device)
    return time.perf_counter() - start


def run_transformers(args, model_dir: Path, load_format: str, dtype: torch.dtype, vocab: int) -> list[dict]:
    model = load_hf(model_dir, load_format, dtype, args.device)
    hf_generate(model, prompts_for(1, args.prompt_len, vocab, seed=99), 4, args.device)  # warm up
    rows = []
    reset_peak(args.device)
    seq_prompts = prompts_for(args.hf_sequential_requests, args.prompt_len, vocab)
    seq_lens = output_lens(args, len(seq_prompts))
    seconds = sum(hf_generate(model, [p], n, args.device) for p, n in zip(seq_prompts, seq_lens))
    seq_rate = sum(seq_lens) / seconds
    seq_peak = peak_gib(args.device)
    tqdm.write(f"hf sequential        : {seq_rate:10.1f} tok/s")
    for c in tqdm(args.concurrency, desc="transformers static batches", dynamic_ncols=True):
        rows.append({"engine": "transformers-sequential", "concurrency": c, "output_tok_s": seq_rate,
                     "ms_per_output_token": 1e3 / seq_rate, "peak_gpu_gib": seq_peak})
        if c > args.hf_static_max:
            continue
        reset_peak(args.device)
        n = c * args.requests_per_slot
        lens, prompts = output_lens(args, n), prompts_for(n, args.prompt_len, vocab)
        wall = sum(hf_generate(model, prompts[i:i + c], max(lens[i:i + c]), args.device) for i in range(0, n, c))
        steps = sum(max(lens[i:i + c]) for i in range(0, n, c))
        rows.append({"engine": "transformers-static-batch", "concurrency": c,
                     "output_tok_s": sum(lens) / wall, "ms_per_output_token": wall / steps * 1e3,
                     "wall_s": wall, "peak_gpu_gib": peak_gib(args.device)})
        tqdm.write(f"hf static batch C={c:4d}: {sum(lens) / wall:10.1f} tok/s")
    return rows


def with_ratios(rows: list[dict]) -> list[dict]:
    by = {(r["engine"], r["concurrency"]): r for r in rows}
    for r in rows:
        if r["engine"] != "pagedserve":
            continue
        c = r["concurrency"]
        for base, key in (("transformers-sequential", "x_vs_hf_sequential"),
                          ("transformers-static-batch", "x_vs_hf_static")):
            if (base, c) in by:
                r[key] = r["output_tok_s"] / by[(base, c)]["output_tok_s"]
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    draw_throughput(ax, rows, title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    if args.shape:
        model_dir, load_format, label = shape_dir(args.shape), "dummy", args.shape
    else:
        from pagedserve.models.default_model import default_model_dir
        model_dir = Path(args.model) if args.model else default_model_dir()
        load_format, label = "auto", model_dir.name
    dtype_name = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    rows, vocab = run_pagedserve(args, model_dir, load_format, dtype_name)
    if not args.no_hf:
        rows += run_transformers(args, model_dir, load_format, getattr(torch, dtype_name), vocab)
    rows = with_ratios(rows)
    name = args.name or f"throughput_{args.device.split(':')[0]}_{label}".replace("/", "_").replace(".", "_")
    if args.tensor_parallel_size > 1 and not args.name:
        name += f"_tp{args.tensor_parallel_size}"
    if args.quick and not args.name:
        name += "_quick"
    cols = ["engine", "concurrency", "output_tok_s", "ms_per_output_token", "peak_gpu_gib", "kv_pool_gib",
            "kv_peak_used_gib", "x_vs_hf_sequential", "x_vs_hf_static"]
    table = markdown_table(sorted(rows, key=lambda r: (r["engine"], r["concurrency"])), cols)
    print(table)
    lengths = f"{args.output_len}" if args.min_output_len is None else f"{args.min_output_len}..{args.output_len}"
    queue = f", {args.requests_per_slot} requests per slot" if args.requests_per_slot > 1 else ""
    queue += ", pagedserve warmed up on each C's prompt shapes" if args.shape_warmup else ""
    tp = f", TP = {args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    own = "the model's own"
    model_len = "" if args.max_model_len is None else f", max_model_len {args.max_model_len or own}"
    title = (f"{label} ({dtype_name}, {args.device}{tp}): prompt {args.prompt_len}, "
             f"output {lengths} tokens, ignore_eos{queue}{model_len}")
    path = save(name, {"model": label, "dtype": dtype_name, "device": args.device, "prompt_len": args.prompt_len,
                       "output_len": args.output_len, "min_output_len": args.min_output_len,
                       "requests_per_slot": args.requests_per_slot, "shape_warmup": args.shape_warmup,
                       "tensor_parallel_size": args.tensor_parallel_size, "max_model_len": args.max_model_len,
                       "rows": rows}, f"## {title}\n\n{table}", args.out)
    if args.plot:
        plot(rows, path.with_suffix(".png"), title)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
