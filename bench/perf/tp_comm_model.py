"""Tensor parallelism on GPUs, on paper: the all-reduce bytes of one step and their expected NVLink time.

What pagedserve's TP moves per step (models/parallel_layers.py), for T tokens in the step:
  2 all-reduces per layer   attention output (row-parallel o_proj) and MLP / MoE block output,
                            each T x hidden x 2 bytes (bf16);
  1 all-reduce              the vocab-parallel embedding lookup, T x hidden x 2 bytes;
  1 gather to the driver    the sampled rows' logits, R x vocab/N x 2 bytes from each other rank.
Ring all-reduce time: 2 (N-1)/N x bytes / bus bandwidth + a fixed latency per collective (the small
messages of decode are latency-bound; --latency-us sets it: NCCL ~10-20 us, a custom one-shot
all-reduce as vLLM's ~5 us). Against it, the step's floor on one GPU of N: the larger of reading
its share of the weights from HBM (decode) and its share of 2 x active params x T FLOPs (prefill;
attention's own FLOPs left out); a MoE step reads only the experts its tokens route to (T x top_k
of E, at most all) and computes top_k of them per token.

    python bench/perf/tp_comm_model.py            # TinyLlama-1.1B, Llama-3-8B, Qwen3-30B-A3B at TP 2/4/8
    python bench/perf/tp_comm_model.py --quick    # the same table (it is arithmetic): checks the script
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.report import arg_parser, markdown_table, save  # noqa: E402

DTYPE_BYTES = 2  # bf16 activations and weights
NVLINK_BUS_GBPS = 360.0  # achievable all-reduce bus bandwidth, H100/H200 NVLink 4 (450 GB/s per direction peak)
ALLREDUCE_LATENCY_US = 15.0  # NCCL small-message all-reduce on one NVLink node: ~10-20 us
HBM_GBPS = {"H100": 3350.0, "H200": 4800.0}  # peak HBM bandwidth; decode reaches ~80% of it
HBM_EFFICIENCY = 0.8
BF16_TFLOPS = 990.0  # H100/H200 SXM dense bf16 peak
FLOP_EFFICIENCY = 0.6


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    vocab: int
    q_size: int
    kv_size: int
    intermediate: int  # dense MLP width (0: every layer MoE)
    tied: bool = False
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0

    def attention_params(self) -> int:
        return self.hidden * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden

    def dense_params(self) -> int:
        """Every weight a step reads whatever its tokens: attention, dense MLPs, routers, embeddings."""
        mlp = 3 * self.hidden * self.intermediate + self.hidden * self.experts
        return self.layers * (self.attention_params() + mlp) + self.vocab * self.hidden * (1 if self.tied else 2)

    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_intermediate  # one expert's gate, up and down

    def flops(self, tokens: int) -> float:
        """2 x the parameters each token multiplies by (its top_k experts of a MoE) x tokens."""
        return 2.0 * tokens * (self.dense_params() + self.layers * self.top_k * self.expert_params())

    def weights_read(self, tokens: int) -> int:
        """Bytes of weights one step over `tokens` tokens reads."""
        touched = min(self.experts, tokens * self.top_k) if self.experts else 0
        return (self.dense_params() + self.layers * touched * self.expert_params()) * DTYPE_BYTES


SHAPES = [
    Shape("TinyLlama-1.1B", hidden=2048, layers=22, vocab=32000, q_size=2048, kv_size=256, intermediate=5632),
    Shape("Llama-3-8B", hidden=4096, layers=32, vocab=128256, q_size=4096, kv_size=1024, intermediate=14336),
    Shape("Qwen3-30B-A3B", hidden=2048, layers=48, vocab=151936, q_size=4096, kv_size=512, intermediate=0,
          experts=128, top_k=8, expert_intermediate=768),
]


def allreduce_us(nbytes: int, ranks: int, latency_us: float) -> float:
    return latency_us + 2 * (ranks - 1) / ranks * nbytes / (NVLINK_BUS_GBPS * 1e3)


def row(shape: Shape, ranks: int, tokens: int, sampled: int, gpu: str, latency_us: float) -> dict:
    per_allreduce = tokens * shape.hidden * DTYPE_BYTES
    count = 2 * shape.layers + 1
    gather_bytes = sampled * (shape.vocab // ranks) * DTYPE_BYTES * (ranks - 1)
    comm_us = count * allreduce_us(per_allreduce, ranks, latency_us) + latency_us + \
        gather_bytes / (NVLINK_BUS_GBPS * 1e3)
    read_us = shape.weights_read(tokens) / ranks / (HBM_GBPS[gpu] * HBM_EFFICIENCY * 1e3)
    math_us = shape.flops(tokens) / ranks / (BF16_TFLOPS * FLOP_EFFICIENCY * 1e6)
    compute_us = max(read_us, math_us)
    return {"model": shape.name, "gpu": gpu, "tp": ranks, "tokens": tokens, "all_reduces": count,
            "KiB_per_all_reduce": per_allreduce / 1024, "MiB_per_step": (count * per_allreduce + gather_bytes) / 2**20,
            "comm_us": comm_us, "compute_us": compute_us, "bound": "memory" if read_us >= math_us else "compute",
            "comm_share": comm_us / (comm_us + compute_us)}


def table_rows(gpu: str, latency_us: float) -> list[dict]:
    # decode batches of 1, 32 and 256 (every token samples), and one 8192-token prefill chunk (one row samples)
    steps = [(1, 1), (32, 32), (256, 256), (8192, 1)]
    return [row(shape, ranks, tokens, sampled, gpu, latency_us) for shape in SHAPES for ranks in (2, 4, 8)
            for tokens, sampled in steps]


def main() -> None:
    ap = arg_parser(__doc__, "the same table (arithmetic only)")
    ap.add_argument("--gpu", choices=sorted(HBM_GBPS), default="H100")
    ap.add_argument("--latency-us", type=float, default=ALLREDUCE_LATENCY_US, help="fixed cost of one collective")
    args = ap.parse_args()
    rows = table_rows(args.gpu, args.latency_us)
    columns = list(rows[0])
    table = markdown_table(rows, columns)
    print(table)
    notes = (f"## Tensor parallelism on {args.gpu}s, on paper\n\n"
             f"bf16; NVLink all-reduce bus bandwidth {NVLINK_BUS_GBPS:.0f} GB/s, {args.latency_us:.0f} us per "
             f"collective; HBM {HBM_GBPS[args.gpu]:.0f} GB/s at {HBM_EFFICIENCY:.0%}, {BF16_TFLOPS:.0f} TFLOP/s at "
             f"{FLOP_EFFICIENCY:.0%}. comm_us: 2 all-reduces per layer + the embedding's + the logits gather; "
             "compute_us: one GPU of N's floor for the step (weight reads or FLOPs, whichever is larger); "
             "comm_share = comm / (comm + compute), nothing overlapped.\n\n")
    save(f"tp_comm_model_{args.gpu}" + ("_quick" if args.quick else ""),
         {"assumptions": {"nvlink_bus_gbps": NVLINK_BUS_GBPS, "allreduce_latency_us": args.latency_us,
                          "hbm_gbps": HBM_GBPS[args.gpu], "hbm_efficiency": HBM_EFFICIENCY,
                          "bf16_tflops": BF16_TFLOPS, "flop_efficiency": FLOP_EFFICIENCY},
          "rows": rows}, notes + table, args.out)


if __name__ == "__main__":
    main()
