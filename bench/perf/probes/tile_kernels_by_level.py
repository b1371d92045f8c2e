"""The three tile matrix kernels (packed_linear_bf16, packed_linear, int8_linear) at a few rows of x, at two
instruction-set levels side by side (default amx and avx512_bf16), on SmolLM2-135M's shapes with cold
weights (copies cycled past 256 MiB), rounds interleaved: GB/s of weights streamed, median over rounds.
First it reports where the levels' results differ in bits (int8: never; the bf16 kernels sum differently).
Session 30 chose the int8 AMX threshold (7 rows) and measured the AMX weight prefetch with it
(bench/results/intel_amx/session30.md). Pin it to measure a 2-core machine:

    taskset -c 0,1 python bench/perf/probes/tile_kernels_by_level.py [--rows 1 4 16] [--levels amx avx512_bf16]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve import _core, ops

SHAPES = (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("lm_head", 49152, 576))
COLD_BYTES = 256 << 20


def median_us(fn, repeats: int = 8, min_seconds: float = 0.04) -> float:
    fn()
    samples, start = [], time.perf_counter()
    while len(samples) < repeats or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def weights(n: int, k: int, generator) -> dict:
    """kernel -> (bytes of one copy, copies cycled so that they exceed the last-level cache)."""
    w = torch.randn(n, k, generator=generator) * 0.05
    packed, q = ops.pack_linear_weight(w), ops.quantize_int8_weight(w)
    packed_bytes, q_bytes = packed.numel() * 2, sum(t.numel() * t.element_size() for t in q)
    packs = [packed] + [packed.clone() for _ in range(max(1, COLD_BYTES // packed_bytes) - 1)]
    qs = [q] + [ops.Int8Weight(*(t.clone() for t in q)) for _ in range(max(1, COLD_BYTES // q_bytes) - 1)]
    return {"bf16": (packed_bytes, packs, ops.packed_linear_bf16), "f32": (packed_bytes, packs, ops.packed_linear),
            "int8": (q_bytes, qs, ops.int8_linear)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 6, 7, 8, 12, 16, 64])
    ap.add_argument("--levels", nargs="+", default=["amx", "avx512_bf16"])
    ap.add_argument("--kernels", nargs="+", default=["bf16", "f32", "int8"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    generator = torch.Generator().manual_seed(0)
    shapes = {name: (n, k, weights(n, k, generator)) for name, n, k in SHAPES}
    for name, (n, k, kernels) in shapes.items():  # where the levels differ in bits
        for kernel in args.kernels:
            _, copies, fn = kernels[kernel]
            x = torch.randn(max(args.rows), k, generator=generator)
            outs = []
            for level in args.levels:
                _core.ops.set_cpu_isa(level)
                outs.append(torch.empty(x.shape[0], n))
                fn(outs[-1], x, copies[0])
            if not all(torch.equal(o, outs[0]) for o in outs):
                print(f"{name} {kernel}: levels differ, max {max(float((o - outs[0]).abs().max()) for o in outs):.3g}")
    us, turn = {}, [0]
    for _ in range(args.rounds):
        for name, (n, k, kernels) in shapes.items():
            for rows in args.rows:
                x, out = torch.randn(rows, k, generator=generator), torch.empty(rows, n)
                for level in args.levels:
                    _core.ops.set_cpu_isa(level)
                    for kernel in args.kernels:
                        _, copies, fn = kernels[kernel]

                        def call():
                            turn[0] += 1
                            fn(out, x, copies[turn[0] % len(copies)])
                        us.setdefault((kernel, name, rows, level), []).append(median_us(call))
    for kernel in args.kernels:
        print(f"\n{kernel}: GB/s | " + " | ".join(args.levels))
        for name, (n, k, kernels) in shapes.items():
            for rows in args.rows:
                gbs = [kernels[kernel][0] / statistics.median(us[(kernel, name, rows, lv)]) / 1e3 for lv in args.levels]
                print(f"{name} {rows} | " + " | ".join(f"{g:.1f}" for g in gbs))


if __name__ == "__main__":
    main()
