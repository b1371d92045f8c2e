"""The three tile matrix kernels (packed_linear_bf16, packed_linear, int8_linear) at a few rows of x, at two
instruction-set levels side by side (default: this CPU's best two, e.g. amx and avx512_bf16), on SmolLM2-135M's
shapes with cold weights (copies cycled past 256 MiB), rounds interleaved: GB/s of weights streamed, median over
rounds, and whether the levels' results differ in bits (int8: never; the bf16 kernels sum in different orders).
Session 30 chose the int8 AMX threshold (7 rows) with it (bench/results/intel_amx/session30.md). Pin it to
measure a 2-core machine:

    taskset -c 0,1 python bench/perf/probes/tile_kernels_by_level.py [--rows 1 4 16] [--levels amx avx512_bf16]
    python bench/perf/probes/tile_kernels_by_level.py --quick    # 1 row, 2 shapes, 1 round
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]
from _cpu_linear_kernels import COLD_BYTES, SHAPES, _median_us  # noqa: E402
from common.report import arg_parser, markdown_table, save  # noqa: E402


def weights(n: int, k: int, generator, cold_bytes: int) -> dict:
    """kernel -> (bytes of one copy, copies cycled so that together they exceed the last-level cache, op)."""
    import torch

    from pagedserve import ops

    w = torch.randn(n, k, generator=generator) * 0.05
    packed, q = ops.pack_linear_weight(w), ops.quantize_int8_weight(w)
    packed_bytes, q_bytes = packed.numel() * 2, sum(t.numel() * t.element_size() for t in q)
    packs = [packed] + [packed.clone() for _ in range(max(1, cold_bytes // packed_bytes) - 1)]
    qs = [q] + [ops.Int8Weight(*(t.clone() for t in q)) for _ in range(max(1, cold_bytes // q_bytes) - 1)]
    return {"bf16": (packed_bytes, packs, ops.packed_linear_bf16), "f32": (packed_bytes, packs, ops.packed_linear),
            "int8": (q_bytes, qs, ops.int8_linear)}


def main() -> None:
    ap = arg_parser(__doc__, "1 row, 2 shapes, 1 round, small weights: checks the script works")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 6, 7, 8, 12, 16, 64])
    ap.add_argument("--levels", nargs="+", default=None, help="instruction-set levels (default: the best two)")
    ap.add_argument("--kernels", nargs="+", default=["bf16", "f32", "int8"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import torch

    from pagedserve import _core

    levels = args.levels or _core.ops.supported_cpu_isas()[-2:]
    shapes_used, rows_list, rounds, cold = SHAPES, args.rows, args.rounds, COLD_BYTES
    if args.quick:
        shapes_used, rows_list, rounds, cold = SHAPES[:2], [1], 1, 1
    generator = torch.Generator().manual_seed(0)
    shapes = {name: (n, k, weights(n, k, generator, cold)) for name, n, k in shapes_used}
    before = _core.ops.cpu_isa()
    differ, us, turn = [], {}, [0]
    try:
        for name, (n, k, kernels) in shapes.items():  # where the levels differ in bits
            x = torch.randn(max(rows_list), k, generator=generator)
            for kernel in args.kernels:
                _, copies, fn = kernels[kernel]
                outs = []
                for level in levels:
                    _core.ops.set_cpu_isa(level)
                    outs.append(torch.empty(x.shape[0], n))
                    fn(outs[-1], x, copies[0])
                if not all(torch.equal(o, outs[0]) for o in outs):
                    differ.append({"shape": name, "kernel": kernel,
                                   "max_abs_diff": max(float((o - outs[0]).abs().max()) for o in outs)})
        for _ in range(rounds):
            for name, (n, k, kernels) in shapes.items():
                for rows in rows_list:
                    x, out = torch.randn(rows, k, generator=generator), torch.empty(rows, n)
                    for level in levels:
                        _core.ops.set_cpu_isa(level)
                        for kernel in args.kernels:
                            _, copies, fn = kernels[kernel]

                            def call(fn=fn, copies=copies):
                                turn[0] += 1
                                fn(out, x, copies[turn[0] % len(copies)])
                            us.setdefault((kernel, name, rows, level), []).append(_median_us(call, 8, 0.04))
    finally:
        _core.ops.set_cpu_isa(before)
    results = [{"kernel": kernel, "shape": name, "rows": rows,
                **{level: shapes[name][2][kernel][0] / statistics.median(us[(kernel, name, rows, level)]) / 1e3
                   for level in levels}}
               for kernel in args.kernels for name in shapes for rows in rows_list]
    md = (f"## Tile kernels by instruction-set level: GB/s of weights, cold, {rounds} interleaved rounds\n\n"
          + markdown_table(results, ["kernel", "shape", "rows", *levels])
          + "\n\nWhere the levels' bits differ:\n\n"
          + (markdown_table(differ, ["shape", "kernel", "max_abs_diff"]) if differ else "nowhere"))
    print(md)
    print("saved", save("tile_kernels_by_level", {"levels": levels, "rows": results, "differ": differ}, md, args.out))


if __name__ == "__main__":
    main()
