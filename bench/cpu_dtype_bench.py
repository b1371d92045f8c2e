"""Which dtype should "auto" pick on a CPU? float32 vs bfloat16 on the default model.

Times the model forward (our ops + torch GEMMs) for a 512-token prefill and
for decode steps of 1 and 16 sequences at context ~300, and measures how far
bf16 logits drift from float32 ones (relative error, greedy agreement).
Prints a table; writes JSON + markdown (default bench/results/cpu_dtype.{json,md}).

    PYTHONPATH=python python bench/cpu_dtype_bench.py [--out bench/results] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

from pagedserve.attention_metadata import AttentionMetadata
from pagedserve.config import ModelConfig
from pagedserve.default_model import default_model_dir
from pagedserve.models import build_model

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


def time_forward(model, batch: Batch, kv_cache: torch.Tensor, repeats: int) -> float:
    def run():
        hidden = model.forward(batch.input_ids, batch.positions, batch.attn, kv_cache)
        return model.compute_logits(hidden[batch.last_token_rows])

    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def drift(models: dict[str, torch.nn.Module], vocab: int) -> dict[str, float]:
    """bf16 vs float32 logits for a 256-token prefill of random text (same KV contents: written by the step)."""
    generator = torch.Generator().manual_seed(1)
    batch = Batch(4, 256, 256, vocab, generator)
    logits = {}
    for name, model in models.items():
        cache = torch.zeros(kv_cache_for(model.config, batch.num_blocks).shape, dtype=model.config.dtype)
        logits[name] = model.compute_logits(model.forward(batch.input_ids, batch.positions, batch.attn, cache))
    ref, low = logits["float32"], logits["bfloat16"]
    return {"relative_error": ((low - ref).norm() / ref.norm()).item(),
            "greedy_agreement": (low.argmax(-1) == ref.argmax(-1)).float().mean().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model_dir = default_model_dir()
    models = {name: build_model(ModelConfig.from_model_dir(model_dir, dtype=name, device="cpu"), "cpu")
              for name in ("float32", "bfloat16")}
    vocab = models["float32"].config.vocab_size
    shapes = {"prefill 512 x 1": (1, 512, 512), "decode 1 @ ctx 300": (1, 300, 1),
              "decode 16 @ ctx 300": (16, 300, 1)}
    rows = []
    for label, (num_seqs, context, q_len) in shapes.items():
        batch = Batch(num_seqs, context, q_len, vocab, torch.Generator().manual_seed(0))
        seconds = {name: time_forward(model, batch, kv_cache_for(model.config, batch.num_blocks), args.repeats)
                   for name, model in models.items()}
        tokens = num_seqs * q_len
        rows.append({"shape": label, "tokens": tokens,
                     "float32_ms": seconds["float32"] * 1e3, "bfloat16_ms": seconds["bfloat16"] * 1e3,
                     "bf16_speedup": seconds["float32"] / seconds["bfloat16"]})
    accuracy = drift(models, vocab)
    report = {"model": str(model_dir), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "cpu": platform.processor() or platform.machine(), "rows": rows, "bf16_vs_fp32": accuracy}
    print_and_save(report, Path(args.out))


def print_and_save(report: dict, out_dir: Path) -> None:
    lines = ["| step | tokens | float32 ms | bfloat16 ms | bf16 speedup |", "|---|---|---|---|---|"]
    for row in report["rows"]:
        lines.append(f"| {row['shape']} | {row['tokens']} | {row['float32_ms']:.1f} | {row['bfloat16_ms']:.1f} | "
                     f"{row['bf16_speedup']:.2f}x |")
    acc = report["bf16_vs_fp32"]
    lines.append("")
    lines.append(f"bf16 vs float32 logits (256-token prefills): relative error {acc['relative_error']:.2e}, "
                 f"greedy agreement {acc['greedy_agreement'] * 100:.1f}%")
    lines.append(f"torch {report['torch']}, {report['threads']} threads")
    text = "\n".join(lines)
    print(text)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cpu_dtype.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "cpu_dtype.md").write_text("# CPU dtype: float32 vs bfloat16 (default model)\n\n" + text + "\n")


if __name__ == "__main__":
    main()
