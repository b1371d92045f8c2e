"""The matrix kernels of cpu_ops_bench.py: packed_linear (float32-exact), packed_linear_float64_sums (the
row-parallel products under float32: float64 sums), packed_linear_bf16 (bf16 activations), int8_linear
(int8 channels) and gguf_linear on Q4_1 blocks (the default model's shipped file; the gguf package makes the
blocks) at SmolLM2-135M's projection shapes, as GB/s of weights streamed and GFLOP/s (2 M N K per product),
per shape, batch size and mode.

At M = 1 a product reads each weight once and does two flops per weight: it is bound by memory
bandwidth, and the figure to compare is GB/s against the LM head's (the largest matrix, the one that
reaches the most bandwidth). At M >= 16 the multiply-adds bind, and GFLOP/s is the figure.
"""

from __future__ import annotations

import statistics
import time

import torch

from pagedserve import ops

# SmolLM2-135M: (name, N, K)
SHAPES = (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
          ("lm_head", 49152, 576))


def _median_us(fn, repeats: int, min_seconds: float) -> float:
    for _ in range(3):
        fn()
    samples, start = [], time.perf_counter()
    while len(samples) < repeats or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
        if len(samples) > 100 * repeats:
            break
    return statistics.median(samples)


# A decode step streams the whole model (270 MB in bf16) from DRAM: cycling through copies of a weight that
# together exceed the last-level cache keeps the small shapes from timing out of cache.
COLD_BYTES = 256 << 20


def _copies(nbytes: int, cold: bool) -> int:
    return max(1, min(64, COLD_BYTES // nbytes)) if cold else 1


def _kernels(weight: torch.Tensor, cold: bool) -> dict:
    """mode -> (weight bytes, fn(out, x)); fn steps through copies of the weight when cold."""
    packed = [ops.pack_linear_weight(weight)]
    packed += [p.clone() for p in packed * (_copies(packed[0].numel() * 2, cold) - 1)]
    q = [ops.quantize_int8_weight(weight)]
    q_bytes = sum(t.numel() * t.element_size() for t in q[0])
    q += [ops.Int8Weight(*(t.clone() for t in q[0])) for _ in range(_copies(q_bytes, cold) - 1)]
    turn = {"i": 0}

    def next_of(items):
        turn["i"] += 1
        return items[turn["i"] % len(items)]

    from gguf import GGMLQuantizationType, quants

    q4_1 = [torch.from_numpy(quants.quantize(weight.numpy(), GGMLQuantizationType.Q4_1))]
    q4_1 += [b.clone() for b in q4_1 * (_copies(q4_1[0].numel(), cold) - 1)]
    q4_1_type = int(GGMLQuantizationType.Q4_1)
    return {"float32": (packed[0].numel() * 2, lambda out, x: ops.packed_linear(out, x, next_of(packed))),
            "float64_sums": (packed[0].numel() * 2,
                             lambda out, x: ops.packed_linear_float64_sums(out, x, next_of(packed))),
            "bfloat16": (packed[0].numel() * 2, lambda out, x: ops.packed_linear_bf16(out, x, next_of(packed))),
            "int8": (q_bytes, lambda out, x: ops.int8_linear(out, x, next_of(q))),
            "gguf_q4_1": (q4_1[0].numel(), lambda out, x: ops.gguf_linear(out, x, next_of(q4_1), q4_1_type))}


def bench_linear(rows_list, repeats: int, min_seconds: float = 0.2, cold: bool = True) -> list[dict]:
    """Every shape x M x mode; cold: weights come from DRAM as in a decode step (see COLD_BYTES)."""
    results = []
    gen = torch.Generator().manual_seed(0)
    for name, n, k in SHAPES:
        kernels = _kernels(torch.randn(n, k, generator=gen) * 0.05, cold)
        for m in rows_list:
            x = torch.randn(m, k, generator=gen)
            out = torch.empty(m, n)
            for mode, (nbytes, fn) in kernels.items():
                us = _median_us(lambda: fn(out, x), repeats, min_seconds)
                results.append(dict(shape=name, N=n, K=k, M=m, mode=mode, us=round(us, 2),
                                    GBps=round(nbytes / us / 1e3, 1), GFLOPps=round(2 * m * n * k / us / 1e3, 1)))
    return results


def print_linear(rows: list[dict]) -> None:
    print(f"\n{'shape':8} {'N':>6} {'K':>5} {'M':>4} {'mode':9} {'us':>9} {'GB/s':>7} {'GFLOP/s':>8}")
    for r in rows:
        print(f"{r['shape']:8} {r['N']:>6} {r['K']:>5} {r['M']:>4} {r['mode']:9} {r['us']:>9} {r['GBps']:>7} "
              f"{r['GFLOPps']:>8}")


def linear_markdown(rows: list[dict], threads: int) -> str:
    lines = ["", f"## Matrix kernels ({threads} threads; kernels {ops.cpu_kernels()})", "",
             "GB/s: weight bytes streamed per second (what binds M = 1), weights cycled through copies larger than the "
             "caches as in a decode step; GFLOP/s: 2 M N K per second.", "",
             "| shape | N | K | M | mode | us | GB/s | GFLOP/s |", "|---|---:|---:|---:|---|---:|---:|---:|"]
    lines += [f"| {r['shape']} | {r['N']} | {r['K']} | {r['M']} | {r['mode']} | {r['us']} | {r['GBps']} | "
              f"{r['GFLOPps']} |" for r in rows]
    return "\n".join(lines) + "\n"
