"""The decode step's products one by one: ops.small_batch_linear (cuda/small_batch_linear.cu) against cuBLAS
(F.linear, plus silu_and_mul for the gated MLP) on the projections of TinyLlama-1.1B and Llama-3-8B, at 1, 2,
4 and 8 rows, as GB/s of weights streamed and as a share of the card's copy bandwidth.

Each figure is one CUDA graph of the same product repeated over enough distinct weight copies that they do
not fit in L2 (the decode step streams every weight once), replayed; the time per product includes what a
chain of products in a decode step pays between kernels (with dependent launches on, the next product's
first loads overlap the end of the one before).

    python bench/perf/small_batch_linear_bench.py          (needs a CUDA GPU and the CUDA build)
    python bench/perf/small_batch_linear_bench.py --quick  # two shapes, one row count
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.report import arg_parser, markdown_table, require_cuda, save  # noqa: E402
from perf.decode_kernels import copy_bandwidth_gbs  # noqa: E402

# name: (K, N, gated); N of a gated product is the output width (W has 2N rows).
SHAPES = {
    "tinyllama qkv": (2048, 2560, False),
    "tinyllama o": (2048, 2048, False),
    "tinyllama gate_up": (2048, 5632, True),
    "tinyllama down": (5632, 2048, False),
    "llama-3-8b qkv": (4096, 6144, False),
    "llama-3-8b o": (4096, 4096, False),
    "llama-3-8b gate_up": (4096, 14336, True),
    "llama-3-8b down": (14336, 4096, False),
}
L2_MARGIN_BYTES = 3 * 64 << 20  # more weight bytes per pass than any Hopper L2 (50-60 MiB) holds


def time_graph(fn, copies: int, replays: int = 20) -> float:
    """Microseconds per product: `copies` products captured in one graph, replayed."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(copies):  # warm-up outside capture (cuBLAS picks its kernels)
            fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(copies):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * copies)


KERNELS = ("small_batch_linear", "cublas")


def measure(name: str, rows: int, copy_gbs: float) -> list[dict]:
    from pagedserve import ops
    k, n, gated = SHAPES[name]
    weight_rows = 2 * n if gated else n
    nbytes = weight_rows * k * 2
    copies = max(2, math.ceil(L2_MARGIN_BYTES / nbytes))
    weights = [torch.randn(weight_rows, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    merged = torch.empty(rows, weight_rows, device="cuda", dtype=torch.bfloat16)

    def ours(i: int) -> None:
        ops.small_batch_linear(out, x, weights[i], None, gated)

    def cublas(i: int) -> None:
        if gated:
            torch.matmul(x, weights[i].T, out=merged)
            ops.silu_and_mul(out, merged)
        else:
            torch.matmul(x, weights[i].T, out=out)

    results = []
    for kernel in KERNELS:
        us = time_graph(ours if kernel == "small_batch_linear" else cublas, copies)
        gbs = nbytes / (us * 1e-6) / 1e9
        results.append({"product": name, "rows": rows, "kernel": kernel, "K": k, "N": n, "gated": gated,
                        "weight_mb": nbytes / 1e6, "us": us, "gb_per_s": gbs, "share_of_copy": gbs / copy_gbs})
    return results


def main() -> None:
    ap = arg_parser(__doc__, "two TinyLlama shapes at one row: checks the script works")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    args = ap.parse_args()
    require_cuda(__file__)
    shapes = ["tinyllama qkv", "tinyllama down"] if args.quick else list(SHAPES)
    rows_list = [1] if args.quick else args.rows
    copy_gbs = copy_bandwidth_gbs()
    # Interleaved: both kernels of a shape and row count run back to back.
    results = [r for name in shapes for rows in rows_list for r in measure(name, rows, copy_gbs)]
    # The step's products together: bytes over time per model shape and row count.
    totals = []
    for model in sorted({name.split()[0] for name in shapes}):
        for rows in rows_list:
            for kernel in KERNELS:
                picked = [r for r in results if r["product"].startswith(model) and r["rows"] == rows
                          and r["kernel"] == kernel]
                mb, us = sum(r["weight_mb"] for r in picked), sum(r["us"] for r in picked)
                totals.append({"model": model, "rows": rows, "kernel": kernel, "us_per_layer": us,
                               "share_of_copy": mb * 1e6 / (us * 1e-6) / 1e9 / copy_gbs})
    text = "\n".join([f"Copy bandwidth {copy_gbs:.0f} GB/s (2 GiB device-to-device copy).", "",
                      markdown_table(totals, list(totals[0])), "",
                      markdown_table(results, ["product", "rows", "kernel", "weight_mb", "us", "gb_per_s",
                                               "share_of_copy"])])
    print(text)
    save("small_batch_linear" + ("_quick" if args.quick else ""),
         {"copy_gb_per_s": copy_gbs, "totals": totals, "products": results},
         "## Small-batch products vs cuBLAS\n\n" + text, args.out)


if __name__ == "__main__":
    main()
