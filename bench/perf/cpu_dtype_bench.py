"""Which dtype should "auto" pick on a CPU? float32 vs bfloat16 on the default model.

Times the model forward (our ops + torch GEMMs) for a 512-token prefill and
for decode steps of 1 and 16 sequences at context ~300, and measures how far
bf16 logits drift from float32 ones (relative error, greedy agreement).
Prints a table; writes JSON + markdown (default bench/results/cpu_dtype.{json,md}).

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=python python bench/perf/cpu_dtype_bench.py [--out DIR] [--repeats 5]
    python bench/perf/cpu_dtype_bench.py --quick       # short shapes, 2 repeats: checks the script works

OMP_WAIT_POLICY=PASSIVE matters on a small shared machine: with torch's default
spin-waiting OpenMP threads, a 1x576 @ 576x1728 GEMM measured ~900 us instead of
~150 us while other processes competed for the 2 cores.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.report import arg_parser, save  # noqa: E402

from pagedserve import ops  # noqa: E402
from pagedserve.models import build_model  # noqa: E402
from pagedserve.models.attention_metadata import AttentionMetadata  # noqa: E402
from pagedserve.models.default_model import default_model_dir  # noqa: E402
from pagedserve.models.model_config import ModelConfig  # noqa: E402

BLOCK_SIZE = 16


class Batch:
    """One step's inputs for `num_seqs` sequences of `context` tokens each, `q_len` of them new."""

    def __init__(self, num_seqs: int, context: int, q_len: int, vocab: int, generator: torch.Generator):
        blocks_per_seq = math.ceil(context / BLOCK_SIZE)
        self.num_blocks = num_seqs * blocks_per_seq
        order = torch.randperm(self.num_blocks, generator=generator).to(torch.int32)
        self.block_tables = order.view(num_seqs, blocks_per_seq)
        positions = torch.arange(context - q_len, context, dtype=torch.int32)
        self.positions = positions.repeat(num_seqs)
        rows = torch.arange(num_seqs, dtype=torch.int32).repeat_interleave(q_len)
        self.slot_mapping = (self.block_tables[rows.long(), (self.positions // BLOCK_SIZE).long()] * BLOCK_SIZE
                             + self.positions % BLOCK_SIZE).to(torch.int32)
        self.input_ids = torch.randint(0, vocab, (num_seqs * q_len,), generator=generator)
        self.attn = AttentionMetadata(
            slot_mapping=self.slot_mapping, block_tables=self.block_tables,
            query_start_loc=torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32),
            seq_lens=torch.full((num_seqs,), context, dtype=torch.int32),
            max_query_len=q_len, max_seq_len=context, num_decodes=num_seqs if q_len == 1 else 0)
        self.last_token_rows = torch.arange(q_len - 1, num_seqs * q_len, q_len)


def kv_cache_for(config: ModelConfig, num_blocks: int) -> torch.Tensor:
    shape = (config.num_layers, 2, num_blocks, config.num_kv_heads, BLOCK_SIZE, config.head_dim)
    return torch.randn(shape, dtype=torch.float32).to(config.dtype) * 0.5


def time_forwards(models: dict[str, torch.nn.Module], batch: Batch, repeats: int) -> dict[str, list[float]]:
    """Seconds per step for each model, the models interleaved so that load from other processes hits both alike."""
    caches = {name: kv_cache_for(model.config, batch.num_blocks) for name, model in models.items()}

    def run(name: str) -> None:
        model = models[name]
        hidden = model.forward(batch.input_ids, batch.positions, batch.attn, caches[name])
        model.compute_logits(hidden[batch.last_token_rows])

    times: dict[str, list[float]] = {name: [] for name in models}
    for name in models:
        run(name)  # warm-up
    for _ in range(repeats):
        for name in models:
            start = time.perf_counter()
            run(name)
            times[name].append(time.perf_counter() - start)
    return times


SAMPLE_TEXT = (
    "The history of paged memory begins with virtual memory systems that split a program's address space into "
    "fixed-size pages, so that physical memory could be handed out in small pieces and shared between processes. "
    "An inference engine does the same with the attention cache: each sequence owns a list of blocks, blocks are "
    "allocated on demand, and identical prefixes can point at the same blocks. Continuous batching then lets new "
    "requests join a running batch at every step, which keeps the accelerator busy while short requests finish.")


def drift(models: dict[str, torch.nn.Module], token_ids: torch.Tensor) -> dict[str, float]:
    """bf16 vs float32 logits over one prefill of token_ids (relative error, greedy agreement per position)."""
    count = token_ids.numel()
    attn = AttentionMetadata(
        slot_mapping=torch.arange(count, dtype=torch.int32),
        block_tables=torch.arange(math.ceil(count / BLOCK_SIZE), dtype=torch.int32)[None],
        query_start_loc=torch.tensor([0, count], dtype=torch.int32), seq_lens=torch.tensor([count], dtype=torch.int32),
        max_query_len=count, max_seq_len=count)
    positions = torch.arange(count, dtype=torch.int32)
    logits = {}
    for name, model in models.items():
        cache = kv_cache_for(model.config, math.ceil(count / BLOCK_SIZE))  # every slot read is written first
        logits[name] = model.compute_logits(model.forward(token_ids, positions, attn, cache))
    ref, low = logits["float32"], logits["bfloat16"]
    return {"tokens": count, "relative_error": ((low - ref).norm() / ref.norm()).item(),
            "greedy_agreement": (low.argmax(-1) == ref.argmax(-1)).float().mean().item()}


def main() -> None:
    parser = arg_parser(__doc__, "64-token shapes, 2 repeats: checks the script works")
    parser.add_argument("--repeats", type=int, default=None, help="timed forwards per shape (default 5, --quick: 2)")
    parser.add_argument("--threads", type=int, default=0, help="torch and ops threads (0: leave the defaults)")
    args = parser.parse_args()
    args.repeats = args.repeats or (2 if args.quick else 5)
    if args.threads:
        torch.set_num_threads(args.threads)
        ops.set_num_threads(args.threads)
    model_dir = default_model_dir()
    models = {name: build_model(ModelConfig.from_model_dir(model_dir, dtype=name, device="cpu"), "cpu")
              for name in ("float32", "bfloat16")}
    vocab = models["float32"].config.vocab_size
    shapes = ({"prefill 64 x 1": (1, 64, 64), "decode 4 @ ctx 64": (4, 64, 1)} if args.quick else
              {"prefill 512 x 1": (1, 512, 512), "decode 1 @ ctx 300": (1, 300, 1),
               "decode 16 @ ctx 300": (16, 300, 1)})
    rows = []
    for label, (num_seqs, context, q_len) in shapes.items():
        batch = Batch(num_seqs, context, q_len, vocab, torch.Generator().manual_seed(0))
        times = time_forwards(models, batch, args.repeats)
        best = {name: min(samples) for name, samples in times.items()}
        rows.append({"shape": label, "tokens": num_seqs * q_len,
                     "float32_ms": best["float32"] * 1e3, "bfloat16_ms": best["bfloat16"] * 1e3,
                     "float32_median_ms": statistics.median(times["float32"]) * 1e3,
                     "bfloat16_median_ms": statistics.median(times["bfloat16"]) * 1e3,
                     "bf16_speedup": best["float32"] / best["bfloat16"]})
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    accuracy = {"natural text": drift(models, torch.tensor(tokenizer(SAMPLE_TEXT).input_ids)),
                "random tokens": drift(models, torch.randint(0, vocab, (256,), generator=torch.Generator().manual_seed(1)))}
    report = {"model": model_dir.name, "device": "cpu",
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "<unset>"), "rows": rows, "bf16_vs_fp32": accuracy}
    print_and_save(report, "cpu_dtype" + ("_quick" if args.quick else ""), args.out)


def print_and_save(report: dict, name: str, out_dir: Path | None) -> None:
    lines = ["| step | tokens | float32 ms (best / median) | bfloat16 ms (best / median) | bf16 speedup (best) |",
             "|---|---|---|---|---|"]
    for row in report["rows"]:
        lines.append(f"| {row['shape']} | {row['tokens']} | {row['float32_ms']:.1f} / {row['float32_median_ms']:.1f} | "
                     f"{row['bfloat16_ms']:.1f} / {row['bfloat16_median_ms']:.1f} | {row['bf16_speedup']:.2f}x |")
    lines.append("")
    for label, acc in report["bf16_vs_fp32"].items():
        lines.append(f"bf16 vs float32 logits, {label} ({acc['tokens']} tokens): relative error "
                     f"{acc['relative_error']:.2e}, greedy agreement {acc['greedy_agreement'] * 100:.1f}%  ")
    lines.append(f"{torch.get_num_threads()} torch threads, OMP_WAIT_POLICY={report['omp_wait_policy']}")
    text = "\n".join(lines)
    print(text)
    path = save(name, report, "# CPU dtype: float32 vs bfloat16 (default model)\n\n" + text, out_dir)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
