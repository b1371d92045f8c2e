"""Dense products of a few decode rows on a GPU, each as 50 back-to-back calls captured in one CUDA graph (so
the kernel boundaries count, as in a decode step): cuBLAS (torch.matmul), ops.grouped_linear with one expert
(the mixture-of-experts mma kernel as a dense product) and ops.silu_and_mul on the gated half, in us per call,
at SmolLM2-135M's and TinyLlama-1.1B's projection shapes. Session 30 asked whether a gated epilogue on the
grouped kernel could replace cuBLAS + silu_and_mul at 3-64 rows (bench/results/h200/session30.md):

    python bench/perf/probes/dense_products_in_graphs.py [--rows 16 32 64]
    python bench/perf/probes/dense_products_in_graphs.py --quick     # one shape, 16 rows
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common.report import arg_parser, markdown_table, require_cuda, save  # noqa: E402

SHAPES = (("smollm2 qkv", 960, 576), ("smollm2 o", 576, 576), ("smollm2 gate_up", 3072, 576),
          ("smollm2 down", 576, 1536), ("tinyllama qkv", 2560, 2048), ("tinyllama gate_up", 11264, 2048),
          ("tinyllama down", 2048, 5632))


def graph_us(fn, calls: int = 50, reps: int = 20) -> float:
    """Best us per call of `calls` captured calls of fn, over `reps` replays."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def main() -> None:
    ap = arg_parser(__doc__, "one shape, 16 rows")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64])
    args = ap.parse_args()
    require_cuda(__file__)
    import torch

    from pagedserve import ops

    torch.manual_seed(0)
    shapes, rows_list = (SHAPES[:1], [16]) if args.quick else (SHAPES, args.rows)
    results = []
    for name, n, k in shapes:
        w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
        for m in rows_list:
            x = torch.randn(m, k, device="cuda").bfloat16()
            offsets = torch.tensor([0, m], dtype=torch.int32, device="cuda")
            out_cublas = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            out_grouped = torch.empty_like(out_cublas)
            act = torch.empty(m, n // 2, dtype=torch.bfloat16, device="cuda")
            row = {"shape": name, "rows": m,
                   "cublas_us": graph_us(lambda: torch.matmul(x, w.t(), out=out_cublas)),
                   "grouped_mma_us": graph_us(lambda: ops.grouped_linear(out_grouped, x, w[None], offsets)),
                   "silu_and_mul_us": graph_us(lambda: ops.silu_and_mul(act, out_cublas))}
            torch.matmul(x, w.t(), out=out_cublas)
            ops.grouped_linear(out_grouped, x, w[None], offsets)
            row["max_abs_diff"] = float((out_cublas.float() - out_grouped.float()).abs().max())
            results.append(row)
            print(row, flush=True)
    md = ("## Dense products in CUDA graphs (bf16, us per call, 50 captured calls)\n\n"
          + markdown_table(results, ["shape", "rows", "cublas_us", "grouped_mma_us", "silu_and_mul_us",
                                     "max_abs_diff"]))
    print(md)
    print("saved", save("dense_products_in_graphs", {"rows": results}, md, args.out))


if __name__ == "__main__":
    main()
