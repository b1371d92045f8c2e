"""GGUF on the CPU: the block kernels' weight bandwidth and a batch-1 decode step, Q4_1 GGUF vs bf16.

Kernels: ops.gguf_linear at M = 1 (a decode step's product) on SmolLM2-135M's shapes (the tied
LM head 49152 x 576, the merged gate/up 3072 x 576, down 576 x 1536) for each block format, in
the file's layout and interleaved as loading makes them
(cpp/ops/gguf_interleaved.h), reported as GB/s of weight bytes streamed, beside the bf16 tiles
(ops.packed_linear) the bf16 model runs. The K-quants (256-weight super-blocks) run those shapes
with K rounded up to 768. The weights stay in cache between repeats (the figures are the
kernels' rate, not DRAM's; a decode step streams from DRAM).

Decode: the default model from its shipped Q4_1 GGUF (blocks kept and interleaved, as loading
does), the same with the blocks left in the file's layout, and the bf16 directory converted from
it, one request generating N tokens greedily, the engines interleaved round by round so a busy
machine slows all alike; ms per generated token and the time ratios.

Layer stack: the linears of 8 TinyLlama-1.1B layers as a Q4_K_M file stores them (Q4_K, ffn_down Q6_K
on every other layer), ~220 MB of distinct weights, so streamed from DRAM as in a decode step, at 1 and
16 rows, file layout against interleaved (alternating per repeat).

    PYTHONPATH=python python bench/perf/gguf_bench.py [--repeats 30] [--rounds 5] [--tokens 64]
    python bench/perf/gguf_bench.py --quick     # few repeats and tokens: checks the script works

Writes bench/results/gguf.json and bench/results/gguf.md.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.gguf_layout import file_layout  # noqa: E402
from common.report import arg_parser, save  # noqa: E402

from pagedserve import ops  # noqa: E402
from pagedserve.testing import gguf_blocks  # noqa: E402

SHAPES = {"lm_head": (49152, 576), "gate_up": (3072, 576), "down": (576, 1536)}
FORMATS = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
INTERLEAVED = " interleaved"  # a format name with this suffix: its blocks through ops.gguf_interleave
PROMPT = "Write a short story about a lighthouse keeper."
FILE_LAYOUT = "Q4_1 GGUF, file layout"


def median_seconds(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def random_blocks(type_name: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Valid blocks of the format (K-quants: random bytes with float16 scales of 0.01; the kernel's speed does
    not depend on the values)."""
    return torch.from_numpy(gguf_blocks.random_blocks(type_name, n, k, rng, 0.01, 0.01))


def bench_kernels(formats: list[str], repeats: int) -> list[dict]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    rng = np.random.default_rng(0)
    rows = []
    for shape_name, (n, k) in SHAPES.items():
        x = torch.randn(1, k)
        out = torch.empty(1, n)
        packed = ops.pack_linear_weight(torch.randn(n, k))
        seconds = median_seconds(lambda: ops.packed_linear(out, x, packed), repeats)
        rows.append(dict(shape=shape_name, n=n, k=k, format="bf16 tiles", us=round(seconds * 1e6, 1),
                         weight_mb=round(packed.numel() * 2 / 1e6, 2), gb_s=round(packed.numel() * 2 / seconds / 1e9, 2)))
        for type_name in formats:
            # K-quants need K % 256 == 0 (576 is not: llama.cpp stores such tensors in other formats), so they
            # run K rounded up (768 for 576): compare their GB/s, not their microseconds, with the others'.
            file_type = type_name.removesuffix(INTERLEAVED)
            elems = GGML_QUANT_SIZES[GGMLQuantizationType[file_type]][0]
            k_type = -(-k // elems) * elems
            x_type = x if k_type == k else torch.randn(1, k_type)
            blocks = random_blocks(file_type, n, k_type, rng)
            qtype = int(GGMLQuantizationType[file_type])
            if type_name.endswith(INTERLEAVED):
                made = ops.gguf_interleave(blocks, qtype)
                if made is None:
                    print(f"{type_name}: no interleaved kernels at this ISA level ({ops.cpu_isa()}); skipped")
                    continue
                blocks, qtype = made
            seconds = median_seconds(lambda: ops.gguf_linear(out, x_type, blocks, qtype), repeats)
            rows.append(dict(shape=shape_name, n=n, k=k_type, format=type_name, us=round(seconds * 1e6, 1),
                             weight_mb=round(blocks.numel() / 1e6, 2), gb_s=round(blocks.numel() / seconds / 1e9, 2)))
    return rows


# A Q4_K_M file's linears of a TinyLlama-1.1B layer (llama.cpp's mix: Q4_K, with ffn_down in Q6_K on half the
# layers; here on every other one) and the layers of a stack too large for the cache: the decode regime.
STACK_LAYER = {"qkv": (2560, 2048, "Q4_K"), "o": (2048, 2048, "Q4_K"), "gate_up": (11264, 2048, "Q4_K"),
               "down": (2048, 5632, "Q6_K")}
STACK_LAYERS = 8


def bench_layer_stack(repeats: int, rows_list=(1, 16)) -> list[dict]:
    """Every linear of STACK_LAYERS layers (distinct weights, ~220 MB) at M rows, file layout vs interleaved,
    the layouts alternating per repeat: GB/s of weight bytes, streamed from DRAM."""
    from gguf import GGMLQuantizationType

    rng = np.random.default_rng(1)
    layouts = {"file layout": [], "interleaved": []}
    for layer in range(STACK_LAYERS):
        for name, (n, k, type_name) in STACK_LAYER.items():
            if name == "down" and layer % 2:
                type_name = "Q4_K"
            blocks, qtype = random_blocks(type_name, n, k, rng), int(GGMLQuantizationType[type_name])
            layouts["file layout"].append((blocks, qtype, n, k))
            made = ops.gguf_interleave(blocks, qtype)
            if made is not None:
                layouts["interleaved"].append((*made, n, k))
    if not layouts["interleaved"]:
        print(f"layer stack: no interleaved kernels at this ISA level ({ops.cpu_isa()}); skipped")
        return []
    weight_bytes = sum(b.numel() for b, *_ in layouts["file layout"])
    rows_out = []
    for rows in rows_list:
        xs = {k: torch.randn(rows, k) for k in {k for *_, k in layouts["file layout"]}}
        outs = {n: torch.empty(rows, n) for n in {n for *_, n, _k in layouts["file layout"]}}

        def run(mats):
            for blocks, qtype, n, k in mats:
                ops.gguf_linear(outs[n], xs[k], blocks, qtype)
        samples = {name: [] for name in layouts}
        for name, mats in layouts.items():
            run(mats)  # warm-up
        for _ in range(repeats):
            for name, mats in layouts.items():
                start = time.perf_counter()
                run(mats)
                samples[name].append(time.perf_counter() - start)
        for name, values in samples.items():
            seconds = statistics.median(values)
            rows_out.append(dict(rows=rows, layout=name, ms=round(seconds * 1e3, 2),
                                 weight_mb=round(weight_bytes / 1e6, 1), gb_s=round(weight_bytes / seconds / 1e9, 2)))
    return rows_out


def bench_decode(rounds: int, tokens: int) -> dict:
    from pagedserve import LLM, SamplingParams
    from pagedserve.models.default_model import default_gguf_path, default_model_dir

    engines = {"Q4_1 GGUF": LLM(model=str(default_gguf_path()), device="cpu", kv_cache_memory_gb=0.25)}
    with file_layout():  # this engine only: the blocks keep the file's layout
        engines[FILE_LAYOUT] = LLM(model=str(default_gguf_path()), device="cpu", kv_cache_memory_gb=0.25)
    engines["bf16"] = LLM(model=str(default_model_dir()), device="cpu", kv_cache_memory_gb=0.25)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for llm in engines.values():  # warm up
        llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    samples: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, llm in engines.items():
            start = time.perf_counter()
            llm.generate([PROMPT], params, use_tqdm=False)
            samples[name].append((time.perf_counter() - start) / tokens * 1e3)
    ms = {name: statistics.median(values) for name, values in samples.items()}
    def ratio(slow: str) -> float:  # median over rounds of that engine's time over the interleaved GGUF's
        return round(statistics.median(s / q for q, s in zip(samples["Q4_1 GGUF"], samples[slow])), 3)

    return dict(tokens=tokens, rounds=rounds, ms_per_token={k: round(v, 3) for k, v in ms.items()},
                tok_s={k: round(1e3 / v, 1) for k, v in ms.items()},
                bf16_over_gguf_time_ratio=ratio("bf16"), file_layout_over_interleaved_time_ratio=ratio(FILE_LAYOUT))


def to_markdown(kernels: list[dict], decode: dict, note: str, stack: list[dict] = ()) -> str:
    lines = ["# GGUF kernels and decode (CPU)", "", note, "",
             "## ops.gguf_linear at M = 1 (weight bytes streamed per second)", "",
             "| shape | N x K | format | us | weight MB | GB/s |", "|---|---|---|---:|---:|---:|"]
    lines += [f"| {r['shape']} | {r['n']} x {r['k']} | {r['format']} | {r['us']} | {r['weight_mb']} | {r['gb_s']} |"
              for r in kernels]
    lines += ["", f"## Decode at batch 1, SmolLM2-135M-Instruct ({decode['tokens']} tokens, {decode['rounds']} "
                  "interleaved rounds)", "", "| weights | ms / token | tok/s |", "|---|---:|---:|"]
    lines += [f"| {name} | {decode['ms_per_token'][name]} | {decode['tok_s'][name]} |" for name in decode["ms_per_token"]]
    lines += ["", "Time ratios, median over rounds: bf16 / Q4_1 GGUF "
                  f"{decode['bf16_over_gguf_time_ratio']}; file layout / interleaved "
                  f"{decode['file_layout_over_interleaved_time_ratio']}", ""]
    if stack:
        lines += [f"## A Q4_K_M stack: {STACK_LAYERS} TinyLlama-1.1B layers' linears (Q4_K; ffn_down Q6_K on every "
                  "other layer), from DRAM", "", "| rows | layout | ms | weight MB | GB/s |",
                  "|---:|---|---:|---:|---:|"]
        lines += [f"| {r['rows']} | {r['layout']} | {r['ms']} | {r['weight_mb']} | {r['gb_s']} |" for r in stack]
        lines += [""]
    return "\n".join(lines)


def main():
    parser = arg_parser(__doc__, "3 repeats, Q4_1 and Q8_0 only, 8 tokens in 1 round: checks the script works")
    parser.add_argument("--repeats", type=int, default=None, help="kernel timings per point (default 30; --quick 3)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved decode rounds (default 5; --quick 1)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per decode run (default 64; --quick 8)")
    parser.add_argument("--note", default="", help="a line added to the markdown (e.g. about the machine's load)")
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 30)
    formats = ["Q4_1", "Q8_0"] if args.quick else list(FORMATS)
    formats += [f + INTERLEAVED for f in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K") if f in formats]
    with torch.inference_mode():
        kernels = bench_kernels(formats, repeats)
        stack = [] if args.quick else bench_layer_stack(max(3, repeats // 3))
    for r in kernels:
        print(f"{r['shape']:8} {r['n']:>6} x {r['k']:<5} {r['format']:10} {r['us']:>9} us {r['gb_s']:>7} GB/s")
    for r in stack:
        print(f"stack M={r['rows']:<3} {r['layout']:12} {r['ms']:>8} ms {r['gb_s']:>7} GB/s")
    decode = bench_decode(args.rounds or (1 if args.quick else 5), args.tokens or (8 if args.quick else 64))
    print(decode)
    path = save("gguf" + ("_quick" if args.quick else ""), dict(device="cpu", threads=ops.num_threads(),
                                                                kernels=kernels, decode=decode, layer_stack=stack),
                to_markdown(kernels, decode, args.note, stack), args.out)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
