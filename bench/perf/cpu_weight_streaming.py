"""How close a batch-1 decode step's matrix products come to the memory bandwidth, on the CPU.

A decode step of one sequence streams every weight once. This builds the default model's linears (SmolLM2-135M:
30 layers of qkv, o, gate_up and down, and the LM head; random weights exact in bf16, 270 MB as bf16 tiles,
135 MB as int8 channels, 96 MB as its GGUF file's blocks (Q4_1 layers, Q8_0 head), these in the file's layout
and interleaved as loading makes them (cpp/ops/gguf_interleaved.h): more than most L3s hold, though the Intel AMX hosts' 300 MiB L3 can hold the int8 set
and a loop over the same weights favours it), runs them all at one row in each CPU format, and compares the
bytes each format streams per second with a plain read (torch sum) and a copy of as many bytes as the bf16 tiles,
on torch threads = --threads (pagedserve's own pool takes every core it may: pin the process, e.g. taskset -c 0,1,
to measure a 2-core machine). Rounds interleave the formats; the best and the median round are reported.

    python bench/perf/cpu_weight_streaming.py [--rounds 5] [--threads 2]
    python bench/perf/cpu_weight_streaming.py --quick     # 4 layers, 2 rounds: checks the script works
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.report import arg_parser, markdown_table, save  # noqa: E402

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down: [out, in]
LM_HEAD = (49152, 576)
FORMATS = ("packed_linear (float32 x)", "packed_linear_bf16 (bf16 x)", "int8_linear", "read", "copy",
           "gguf_linear (file layout)", "gguf_linear (interleaved)")


def build_weights(layers: int):
    import torch

    from pagedserve import ops

    generator = torch.Generator().manual_seed(0)
    weights = []
    for n, k in [shape for _ in range(layers) for shape in LAYER_SHAPES] + [LM_HEAD]:
        w = (torch.randn(n, k, generator=generator) * 0.02).bfloat16().float()
        weights.append((n, k, ops.pack_linear_weight(w), ops.quantize_int8_weight(w), torch.randn(1, k),
                        torch.empty(1, n), gguf_blocks(w, (n, k) == LM_HEAD)))
    return weights


def gguf_blocks(w, lm_head: bool) -> dict:
    """The GGUF blocks of w as the default model's file has them (Q8_0 head, Q4_1 layers): the file's layout
    and the interleaved one (None where this CPU has no kernel for it), each with its type number."""
    import torch
    from gguf import GGMLQuantizationType, quants

    from pagedserve import ops

    qtype = int(GGMLQuantizationType.Q8_0 if lm_head else GGMLQuantizationType.Q4_1)
    blocks = torch.from_numpy(quants.quantize(w.numpy(), qtype))
    return {"file": (blocks, qtype), "interleaved": ops.gguf_interleave(blocks, qtype)}


def main() -> None:
    ap = arg_parser(__doc__, "4 layers, 2 rounds: checks the script works")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="torch threads for the read and the copy")
    args = ap.parse_args()
    import torch

    from pagedserve import _core, ops

    torch.set_num_threads(args.threads)
    weights = build_weights(4 if args.quick else 30)
    bf16_bytes = sum(2 * n * k for n, k, *_ in weights)
    int8_bytes = sum(n * k for n, k, *_ in weights)
    source = torch.empty(bf16_bytes // 4, dtype=torch.float32).uniform_()
    target = torch.empty_like(source)
    gguf_bytes = sum(g["file"][0].numel() for *_, g in weights)
    runs = {
        FORMATS[0]: lambda: [ops.packed_linear(out, x, p) for _, _, p, _, x, out, _ in weights],
        FORMATS[1]: lambda: [ops.packed_linear_bf16(out, x, p) for _, _, p, _, x, out, _ in weights],
        FORMATS[2]: lambda: [ops.int8_linear(out, x, q) for _, _, _, q, x, out, _ in weights],
        FORMATS[3]: lambda: source.sum(),
        FORMATS[4]: lambda: target.copy_(source),
        FORMATS[5]: lambda: [ops.gguf_linear(out, x, *g["file"]) for *_, x, out, g in weights],
        FORMATS[6]: lambda: [ops.gguf_linear(out, x, *g["interleaved"]) for *_, x, out, g in weights],
    }
    streamed = {FORMATS[0]: bf16_bytes, FORMATS[1]: bf16_bytes, FORMATS[2]: int8_bytes, FORMATS[3]: bf16_bytes,
                FORMATS[4]: 2 * bf16_bytes, FORMATS[5]: gguf_bytes, FORMATS[6]: gguf_bytes}
    if weights[0][-1]["interleaved"] is None:  # below AVX2: no interleaved kernels
        del runs[FORMATS[6]]
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    rounds = 2 if args.quick else args.rounds
    names = list(runs)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            start = time.perf_counter()
            runs[name]()
            seconds[name].append(time.perf_counter() - start)
    rows = [{"what": name, "mb_streamed": streamed[name] / 1e6, "best_ms": min(s) * 1e3,
             "median_ms": statistics.median(s) * 1e3, "best_gb_s": streamed[name] / min(s) / 1e9,
             "median_gb_s": streamed[name] / statistics.median(s) / 1e9} for name, s in seconds.items()]
    read = rows[3]["best_gb_s"]
    for row in rows:
        row["share_of_read"] = row["best_gb_s"] / read
    table = markdown_table(rows, ["what", "mb_streamed", "best_ms", "median_ms", "best_gb_s", "median_gb_s",
                                  "share_of_read"])
    kernels = {"cpu_isa": ops.cpu_isa(), "int8_linear_kernel": _core.ops.int8_linear_kernel()}
    print(kernels)
    print(table)
    save("cpu_weight_streaming" + ("_quick" if args.quick else ""),
         {"rounds": rounds, "threads": args.threads, "kernels": kernels, "rows": rows},
         f"## Batch-1 linears streamed from memory ({'4' if args.quick else '30'} layers of SmolLM2-135M + its LM "
         f"head, one row)\n\nCPU ops: {kernels['cpu_isa']}, int8_linear: {kernels['int8_linear_kernel']}; "
         f"{rounds} interleaved rounds; read and copy: torch on {args.threads} threads.\n\n" + table, args.out)


if __name__ == "__main__":
    main()
