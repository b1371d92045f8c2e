"""Times pagedserve's CPU ops against the equivalent torch code at SmolLM2-135M shapes.

Two steps of one layer are measured: a decode step of 16 sequences with contexts of about 300
tokens, and a 512-token prefill. Each op runs on the same inputs as its torch counterpart
(HF-style RMSNorm / rotary / SiLU-and-mul, index_put into the cache, and attention as K/V
gathered through the block table followed by scaled_dot_product_attention).

    PYTHONPATH=python python bench/perf/cpu_ops_bench.py [--dtypes float32 bfloat16] [--repeats 50] [--threads 1 16]
    python bench/perf/cpu_ops_bench.py --quick        # 3 repeats, one thread: checks the script works

Then the matrix kernels (_cpu_linear_kernels.py): GB/s and GFLOP/s per SmolLM2 projection shape, batch size
(--linear-rows, default 1 16 64; --quick: 1 16) and mode (float32, bfloat16, int8), with every core.

Prints a table and writes bench/results/cpu_ops.json and bench/results/cpu_ops.md.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.report import arg_parser, save  # noqa: E402

from pagedserve import ops  # noqa: E402
from _cpu_linear_kernels import bench_linear, linear_markdown, print_linear  # noqa: E402

# SmolLM2-135M
HIDDEN = 576
Q_HEADS = 9
KV_HEADS = 3
HEAD_DIM = 64
INTERMEDIATE = 1536
ROPE_THETA = 100000.0
EPS = 1e-5
BLOCK_SIZE = 16
MAX_POSITION = 8192


def time_us(fn, repeats: int, warmup: int = 5) -> float:
    """Median wall time of fn() in microseconds."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


# ---------------------------------------------------------------------------
# Torch references (what a plain-torch engine would run)


def torch_rms_norm(x, weight):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * xf.to(x.dtype)


def torch_fused_add_rms_norm(x, residual, weight):
    residual = x + residual
    return torch_rms_norm(residual, weight), residual


def torch_rotary(positions, query, key, cos_sin):
    half = cos_sin.shape[1] // 2
    cos = cos_sin[positions, :half].repeat(1, 2)[:, None].to(query.dtype)
    sin = cos_sin[positions, half:].repeat(1, 2)[:, None].to(query.dtype)

    def rotate_half(x):
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin


def torch_silu_and_mul(x):
    return F.silu(x[:, :INTERMEDIATE]) * x[:, INTERMEDIATE:]


def torch_reshape_and_cache(key, value, key_cache, value_cache, slots):
    blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    key_cache[blocks, :, offsets] = key
    value_cache[blocks, :, offsets] = value


def torch_paged_attention(query, key_cache, value_cache, block_tables, starts, seq_lens, scale):
    """Per sequence: gather its K/V through the block table, then SDPA with the causal offset mask."""
    out = torch.empty_like(query)
    group = Q_HEADS // KV_HEADS
    for s in range(len(seq_lens)):
        seq_len, begin, end = seq_lens[s], starts[s], starts[s + 1]
        q_len = end - begin
        positions = torch.arange(seq_len)
        blocks = block_tables[s, positions // BLOCK_SIZE]
        k = key_cache[blocks, :, positions % BLOCK_SIZE].transpose(0, 1).repeat_interleave(group, 0)
        v = value_cache[blocks, :, positions % BLOCK_SIZE].transpose(0, 1).repeat_interleave(group, 0)
        q = query[begin:end].transpose(0, 1)
        if q_len == 1:
            o = F.scaled_dot_product_attention(q, k, v, scale=scale)
        elif q_len == seq_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            mask = torch.arange(seq_len)[None] <= (seq_len - q_len + torch.arange(q_len))[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[begin:end] = o.transpose(0, 1)
    return out


def torch_padded_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale):
    """All decodes at once: gather every context padded to the longest, one batched SDPA with a length mask."""
    max_len = int(seq_lens.max())
    positions = torch.arange(max_len)
    blocks = block_tables[:, positions // BLOCK_SIZE]  # [S, L]
    offsets = (positions % BLOCK_SIZE).expand_as(blocks)
    k = key_cache[blocks, :, offsets].permute(0, 2, 1, 3)  # [S, Hkv, L, D]
    v = value_cache[blocks, :, offsets].permute(0, 2, 1, 3)
    mask = (positions[None] < seq_lens[:, None])[:, None, None, :]
    q = query[:, :, None, :]  # [S, Hq, 1, D]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[:, :, 0]


# ---------------------------------------------------------------------------


def make_step(kind: str, dtype, gen):
    """Inputs of one layer for a decode step (16 x ~300 context) or a 512-token prefill."""
    if kind == "decode":
        seq_lens = torch.randint(280, 321, (16,), generator=gen, dtype=torch.int32)
        q_lens = [1] * 16
    else:
        seq_lens = torch.tensor([512], dtype=torch.int32)
        q_lens = [512]
    blocks_per_seq = [math.ceil(int(n) / BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 8
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_tables = torch.zeros(len(q_lens), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = perm[used:used + n]
        used += n
    starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    tokens = int(starts[-1])
    positions = torch.cat([torch.arange(int(n) - q, int(n)) for n, q in zip(seq_lens, q_lens)]).to(torch.int32)
    seq_of_token = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    slots = (block_tables[seq_of_token, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE).to(torch.int32)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return dict(
        tokens=tokens,
        x=rand(tokens, HIDDEN),
        residual=rand(tokens, HIDDEN),
        weight=rand(HIDDEN),
        positions=positions,
        query=rand(tokens, Q_HEADS, HEAD_DIM),
        key=rand(tokens, KV_HEADS, HEAD_DIM),
        value=rand(tokens, KV_HEADS, HEAD_DIM),
        gate_up=rand(tokens, 2 * INTERMEDIATE),
        key_cache=rand(num_blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM),
        value_cache=rand(num_blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM),
        slots=slots,
        block_tables=block_tables,
        starts=starts,
        seq_lens=seq_lens,
        max_query_len=max(q_lens),
        max_seq_len=int(seq_lens.max()),
    )


def bench_step(kind: str, dtype, repeats: int, gen) -> list[dict]:
    st = make_step(kind, dtype, gen)
    cos_sin = ops.rope_cos_sin_cache(MAX_POSITION, HEAD_DIM, ROPE_THETA)
    scale = HEAD_DIM ** -0.5
    out_norm = torch.empty_like(st["x"])
    out_act = torch.empty(st["tokens"], INTERMEDIATE, dtype=dtype)
    out_attn = torch.empty_like(st["query"])
    positions_long = st["positions"].long()
    slots_long = st["slots"].long()
    starts_list = st["starts"].tolist()
    seq_lens_list = st["seq_lens"].tolist()
    tables_long = st["block_tables"].long()

    def ours_attention():
        ops.paged_attention(out_attn, st["query"], st["key_cache"], st["value_cache"], st["block_tables"],
                            st["starts"], st["seq_lens"], scale, st["max_query_len"], st["max_seq_len"])

    cases = [
        ("rms_norm",
         lambda: ops.rms_norm(out_norm, st["x"], st["weight"], EPS),
         lambda: torch_rms_norm(st["x"], st["weight"])),
        ("fused_add_rms_norm",
         lambda: ops.fused_add_rms_norm(st["x"], st["residual"], st["weight"], EPS),
         lambda: torch_fused_add_rms_norm(st["x"], st["residual"], st["weight"])),
        ("rotary_embedding",
         lambda: ops.rotary_embedding(st["positions"], st["query"], st["key"], cos_sin),
         lambda: torch_rotary(positions_long, st["query"], st["key"], cos_sin)),
        ("silu_and_mul",
         lambda: ops.silu_and_mul(out_act, st["gate_up"]),
         lambda: torch_silu_and_mul(st["gate_up"])),
        ("reshape_and_cache",
         lambda: ops.reshape_and_cache(st["key"], st["value"], st["key_cache"], st["value_cache"], st["slots"]),
         lambda: torch_reshape_and_cache(st["key"], st["value"], st["key_cache"], st["value_cache"], slots_long)),
        ("paged_attention",
         ours_attention,
         lambda: torch_paged_attention(st["query"], st["key_cache"], st["value_cache"], tables_long, starts_list,
                                       seq_lens_list, scale)),
    ]
    if kind == "decode":
        cases.append(("paged_attention (torch: padded batch)", ours_attention,
                      lambda: torch_padded_decode_attention(st["query"], st["key_cache"], st["value_cache"],
                                                            tables_long, st["seq_lens"].long(), scale)))

    # Sanity: the attention being timed agrees with the torch code it is timed against.
    ours_attention()
    reference = torch_paged_attention(st["query"].float(), st["key_cache"].float(), st["value_cache"].float(),
                                      tables_long, starts_list, seq_lens_list, scale)
    max_error = (out_attn.float() - reference).abs().max().item()
    assert max_error < (1e-4 if dtype == torch.float32 else 3e-2), f"attention mismatch: {max_error}"

    rows = []
    for name, ours, theirs in cases:
        ours_us = time_us(ours, repeats)
        torch_us = time_us(theirs, repeats)
        rows.append(dict(step=kind, dtype=str(dtype).removeprefix("torch."), op=name, tokens=st["tokens"],
                         pagedserve_us=round(ours_us, 1), torch_us=round(torch_us, 1),
                         speedup=round(torch_us / ours_us, 2)))
    return rows


def call_overhead_us(repeats: int) -> float:
    """Fixed cost of one op call from Python (DLPack export, pybind11, checks) on a tiny tensor."""
    x = torch.randn(1, 2)
    out = torch.empty(1, 1)
    return time_us(lambda: ops.silu_and_mul(out, x), repeats * 20)


def to_markdown(rows: list[dict], overhead: float, note: str) -> str:
    lines = [
        "# CPU ops vs torch (SmolLM2-135M shapes, one layer)",
        "",
        f"torch with {torch.backends.cpu.get_cpu_capability()} kernels; pagedserve CPU ops with {ops.cpu_isa()} "
        "kernels. Both use the same thread count (first column). Median of repeated runs; shared machines are "
        "noisy, so compare within a run.",
        "",
        "Decode: 16 sequences, contexts 280-320 tokens. Prefill: one 512-token prompt. "
        f"Hidden {HIDDEN}, {Q_HEADS} q / {KV_HEADS} kv heads, head dim {HEAD_DIM}, MLP {INTERMEDIATE}, "
        f"block size {BLOCK_SIZE}.",
        "",
        "| threads | step | dtype | op | tokens | pagedserve (us) | torch (us) | speedup |",
        "|---:|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['threads']} | {r['step']} | {r['dtype']} | {r['op']} | {r['tokens']} | "
                     f"{r['pagedserve_us']} | {r['torch_us']} | {r['speedup']}x |")
    lines += ["", f"Fixed cost of one op call from Python (tiny tensors): {overhead:.2f} us.", ""]
    if note:
        lines += [note, ""]
    return "\n".join(lines)


def main():
    parser = arg_parser(__doc__, "3 repeats on one thread: checks the script works")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=None, help="default 50 (--quick: 3)")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="thread counts to measure, each used by both torch and pagedserve "
                             "(default 1 and every core; --quick: 1)")
    parser.add_argument("--linear-rows", type=int, nargs="+", default=None,
                        help="batch sizes M of the matrix kernels (default 1 16 64; --quick: 1 16)")
    parser.add_argument("--note", default="", help="a line added to the markdown (e.g. about the machine's load)")
    args = parser.parse_args()
    args.repeats = args.repeats or (3 if args.quick else 50)
    args.threads = args.threads or ([1] if args.quick else sorted({1, os.cpu_count() or 1}))

    rows = []
    with torch.inference_mode():
        for threads in args.threads:
            torch.set_num_threads(threads)
            ops.set_num_threads(threads)
            for dtype_name in args.dtypes:
                gen = torch.Generator().manual_seed(0)
                for kind in ("decode", "prefill"):
                    rows += [dict(threads=threads, **row) for row in bench_step(kind, getattr(torch, dtype_name),
                                                                                 args.repeats, gen)]
    overhead = call_overhead_us(args.repeats)
    linear_threads = os.cpu_count() or 1
    ops.set_num_threads(linear_threads)
    linear_rows = bench_linear(args.linear_rows or ([1, 16] if args.quick else [1, 16, 64]),
                               repeats=args.repeats, min_seconds=0.05 if args.quick else 0.5)

    header = (f"{'threads':>7} {'step':8} {'dtype':9} {'op':38} {'tokens':>6} {'ours us':>10} {'torch us':>10} "
              f"{'speedup':>8}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['threads']:>7} {r['step']:8} {r['dtype']:9} {r['op']:38} {r['tokens']:>6} {r['pagedserve_us']:>10} "
              f"{r['torch_us']:>10} {r['speedup']:>7}x")
    print(f"\nfixed cost of one op call from Python: {overhead:.2f} us")
    print_linear(linear_rows)

    path = save("cpu_ops" + ("_quick" if args.quick else ""),
                dict(device="cpu", torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
                     call_overhead_us=round(overhead, 2), results=rows, cpu_kernels=ops.cpu_kernels(),
                     linear=linear_rows, linear_threads=linear_threads),
                to_markdown(rows, overhead, args.note) + linear_markdown(linear_rows, linear_threads), args.out)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
