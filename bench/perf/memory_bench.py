"""KV memory: paged blocks against per-request contiguous buffers, same memory, same workload.

A seeded workload with a realistic spread of output lengths (a third finish
within ~20 tokens, a quarter run 1,000+) goes through three KV schemes given
the same memory, row limit and token budget:

  contiguous    each request reserves max_model_len slots on admission
  grow-by-copy  each request's buffer doubles when full (old and new both held
                while the KV is copied)
  pagedserve    the real scheduler and block pool (pagedserve._core), driven
                with made-up sampled tokens: no model runs

Reported per scheme: KV reserved vs used (time-averaged while the workload
runs), internal fragmentation, the worst waste of one sequence (paged: checked
to be less than one block), how many sequences run at once, steps to finish
the workload, preemptions. Also each request's reservation at its final length,
as plain arithmetic. No timing here: every figure is deterministic.

    python bench/perf/memory_bench.py                 # 600 requests, 2 GiB of TinyLlama-1.1B KV
    python bench/perf/memory_bench.py --quick         # CI: seconds
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _kv_schemes import (  # noqa: E402
    ContiguousScheme,
    GrowByCopyScheme,
    Request,
    SchedulingLimits,
    Trace,
    next_pow2,
    simulate_contiguous,
    simulate_paged,
)
from common.report import markdown_table, save  # noqa: E402
from common.model_shapes import SHAPES  # noqa: E402

PAGED = "pagedserve (16-token blocks)"
# Output length classes: (share of requests, shortest, longest).
OUTPUT_MIX = ((0.30, 5, 20), (0.45, 50, 500), (0.25, 1000, 2000))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=600)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    ap.add_argument("--long-output", type=int, nargs=2, default=[1000, 2000], metavar=("MIN", "MAX"),
                    help="output lengths of the long quarter of the requests")
    ap.add_argument("--kv-gib", type=float, default=2.0, help="KV memory given to every scheme")
    ap.add_argument("--shape", default="tinyllama-1.1b", help="model shape that sets bytes per token (bf16)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: the workload's longest request, rounded up to 256 (kind to the contiguous "
                         "baseline; a server reserves its configured context, often 4096 or more)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks that the script works")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.long_output, args.kv_gib = 48, [150, 300], 0.05
    return args


def kv_bytes_per_token(shape: str) -> int:
    cfg = SHAPES[shape]
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 2  # keys and values, bf16


def make_workload(args) -> list[Request]:
    rng = np.random.default_rng(args.seed)
    mix = (OUTPUT_MIX[0], OUTPUT_MIX[1], (OUTPUT_MIX[2][0], *args.long_output))
    classes = rng.choice(len(mix), size=args.num_requests, p=[m[0] for m in mix])
    requests = []
    for c in classes:
        _, lo, hi = mix[c]
        requests.append(Request(int(rng.integers(args.prompt_len[0], args.prompt_len[1] + 1)),
                                int(rng.integers(lo, hi + 1))))
    return requests


def final_length_accounting(requests: list[Request], limits: SchedulingLimits) -> list[dict]:
    """Each request's reservation at its final length: plain arithmetic, no scheduling."""
    lengths = [r.prompt_len + r.output_len - 1 for r in requests]  # the last sampled token is never cached
    bs = limits.block_size
    schemes = {
        "contiguous (max_model_len each)": [limits.max_model_len] * len(lengths),
        "grow-by-copy (capacity doubling)": [min(next_pow2(n), limits.max_model_len) for n in lengths],
        PAGED: [math.ceil(n / bs) * bs for n in lengths],
    }
    rows = []
    for name, reserved in schemes.items():
        waste = [r - n for r, n in zip(reserved, lengths)]
        rows.append({"scheme": name, "used_tokens": sum(lengths), "reserved_tokens": sum(reserved),
                     "utilization": sum(lengths) / sum(reserved), "mean_waste_per_seq": statistics.mean(waste),
                     "max_waste_per_seq": max(waste),
                     "seqs_fit_at_mean_reservation": limits.memory_tokens / statistics.mean(reserved)})
    return rows


def summarize(name: str, trace: Trace, limits: SchedulingLimits, bytes_per_token: int) -> dict:
    reserved, used = statistics.mean(trace.reserved), statistics.mean(trace.used)
    return {"scheme": name, "steps": trace.steps, "seqs_fit": trace.running_while_queued(),
            "mean_running_seqs": statistics.mean(trace.running),
            "peak_running_seqs": max(trace.running), "mean_reserved_gib": reserved * bytes_per_token / 2**30,
            "mean_used_gib": used * bytes_per_token / 2**30, "utilization": used / reserved,
            "internal_fragmentation": (reserved - used) / reserved, "max_waste_per_seq": trace.max_waste_per_seq,
            "peak_incl_copies_gib": trace.peak_with_copies * bytes_per_token / 2**30,
            "preemptions": trace.preemptions, "recomputed_tokens": trace.recomputed_tokens,
            "memory_gib": limits.memory_tokens * bytes_per_token / 2**30}


def run_schemes(requests: list[Request], limits: SchedulingLimits) -> dict[str, Trace]:
    from tqdm.auto import tqdm
    traces = {}
    for name, run in ((PAGED, lambda cb: simulate_paged(limits, requests, cb)),
                      (GrowByCopyScheme.name, lambda cb: simulate_contiguous(GrowByCopyScheme(limits), requests, cb)),
                      (ContiguousScheme.name, lambda cb: simulate_contiguous(ContiguousScheme(limits), requests, cb))):
        with tqdm(total=len(requests), desc=name, dynamic_ncols=True) as bar:
            traces[name] = run(bar.update)
    return traces


def plot(traces: dict[str, Trace], rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["scheme"] for r in rows]
    x = np.arange(len(names))
    left.bar(x - 0.2, [r["mean_reserved_gib"] for r in rows], 0.4, label="reserved")
    left.bar(x + 0.2, [r["mean_used_gib"] for r in rows], 0.4, label="holding KV")
    left.set_xticks(x, [n.split(" (")[0] for n in names])
    left.set_ylabel("KV memory, mean over the run (GiB)")
    left.legend()
    left.set_title("reserved vs used")
    for name, trace in traces.items():
        right.plot(np.arange(trace.steps), trace.running, label=name.split(" (")[0], linewidth=1)
    right.set_xlabel("step")
    right.set_ylabel("sequences running")
    right.set_title("concurrency in the same memory")
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    args = parse_args()
    requests = make_workload(args)
    longest = max(r.prompt_len + r.output_len for r in requests)
    bytes_per_token = kv_bytes_per_token(args.shape)
    limits = SchedulingLimits(
        memory_tokens=int(args.kv_gib * 2**30 // bytes_per_token) // args.block_size * args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len or math.ceil(longest / 256) * 256, block_size=args.block_size)
    traces = run_schemes(requests, limits)
    rows = [summarize(name, trace, limits, bytes_per_token) for name, trace in traces.items()]
    paged = rows[0]
    assert paged["max_waste_per_seq"] < args.block_size, "paged waste is bounded by one partly filled block"
    for r in rows:
        r["x_seqs_vs_this"] = paged["seqs_fit"] / r["seqs_fit"]
    static = final_length_accounting(requests, limits)
    outputs = [r.output_len for r in requests]
    mix = [(share, [lo, hi]) for share, lo, hi in OUTPUT_MIX[:2]] + [(OUTPUT_MIX[2][0], args.long_output)]
    workload = {"num_requests": len(requests), "prompt_len": args.prompt_len,
                "output_mix": [{"share": share, "range": rng} for share, rng in mix],
                "output_len_p10_p50_p90": [int(np.percentile(outputs, p)) for p in (10, 50, 90)],
        "max_model_len": limits.max_model_len, "memory_tokens": limits.memory_tokens,
        "kv_bytes_per_token": bytes_per_token, "shape": args.shape, "seed": args.seed}
    sim_cols = ["scheme", "seqs_fit", "mean_running_seqs", "peak_running_seqs", "mean_reserved_gib", "mean_used_gib",
                "utilization", "internal_fragmentation", "max_waste_per_seq", "peak_incl_copies_gib", "steps",
                "preemptions", "recomputed_tokens", "x_seqs_vs_this"]
    static_cols = ["scheme", "reserved_tokens", "used_tokens", "utilization", "mean_waste_per_seq",
                   "max_waste_per_seq", "seqs_fit_at_mean_reservation"]
    title = (f"{len(requests)} requests, prompts {args.prompt_len[0]}..{args.prompt_len[1]}, outputs p10/p50/p90 "
             f"{'/'.join(map(str, workload['output_len_p10_p50_p90']))} (max {max(outputs)}); "
             f"{args.kv_gib:g} GiB of {args.shape} KV ({limits.memory_tokens} token slots), "
             f"max_model_len {limits.max_model_len}")
    md = (f"## KV memory: paged vs contiguous\n\n{title}.\n\n### Simulated over the whole workload (same memory)\n\n"
          f"{markdown_table(rows, sim_cols)}\n\n"
          "seqs_fit = mean sequences running while requests wait (the memory is the limit); utilization = KV "
          "held / reserved, time-averaged over all steps; max_waste_per_seq in token slots (paged: checked < one "
          "block); peak_incl_copies: reserved plus old buffers alive during grow-by-copy copies; "
          "steps = scheduler steps to serve the whole workload (fewer sequences at once, more steps); "
          "x_seqs_vs_this = pagedserve's seqs_fit / this scheme's.\n\n"
          f"### Each request's reservation at its final length\n\n{markdown_table(static, static_cols)}")
    print(md)
    path = save("memory" + ("_quick" if args.quick else ""), {"workload": workload, "rows": rows,
                                                                "final_length": static}, md, args.out)
    if not args.no_plot:
        plot(traces, rows, path.with_suffix(".png"), "KV memory: " + title.split(";")[1].strip())
    print(f"saved {path}")


if __name__ == "__main__":
    main()
