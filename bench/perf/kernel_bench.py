"""Kernel benchmark of pagedserve's CUDA ops, against the device's own ceilings.

Measures in one run, on one GPU:
  * device-to-device copy bandwidth (bytes read + written by a 2 GiB torch copy);
  * the bf16 matmul rate (8192^3 torch.matmul on random data);
  * the decode attention kernel (64 rows x 4096 tokens, 32 q / 8 kv heads,
    D 128, bf16: achieved GB/s and % of the copy bandwidth; target >= 70 %)
    and a batch x context sweep; batches of mixed contexts (Qwen3-0.6B's
    16 / 8 heads) in row order and longest first (the runner's decode_order);
  * the prefill kernel (one causal prompt of 4096 tokens, 32 / 8 heads, D 128,
    bf16: TFLOP/s and % of the matmul rate, FLOPs = 4 * S^2 / 2 * D * Hq;
    target >= 40 %), also at 512, 1024 and 2048 tokens (--prefill-only: the
    matmul rate and this alone);
  * the small fused ops at TinyLlama-1.1B shapes (hidden 2048, 32 / 4 heads,
    D 64, intermediate 5632) against the equivalent eager torch code.

Every time is the median over repeated replays of a CUDA graph holding many
launches (so host overhead is out), with inputs rotated across buffers larger
than L2 where the data would otherwise stay cached. Results are printed and
saved as JSON and markdown under --out (bench/results/kernel_bench.{json,md}).

    python bench/perf/kernel_bench.py [--out DIR] [--quick] [--prefill-only]   (needs a CUDA GPU and the CUDA build)
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import torch
from torch.utils.dlpack import to_dlpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.report import arg_parser, require_cuda, save  # noqa: E402

from pagedserve import _core  # noqa: E402

DECODE_TARGET = 0.70  # of the copy bandwidth
PREFILL_TARGET = 0.40  # of the bf16 matmul rate (issue 16)
ROTATE_BYTES = 512 << 20  # rotate inputs over at least this much memory (H100/H200 L2: 50-60 MB)


def cuda_op(name, *args, **options):
    args = [to_dlpack(a) if isinstance(a, torch.Tensor) else a for a in args]
    options = {key: to_dlpack(v) if isinstance(v, torch.Tensor) else v for key, v in options.items()}
    getattr(_core.cuda_ops, name)(*args, stream=torch.cuda.current_stream().cuda_stream, **options)


def time_per_call_ms(calls, rounds: int, repeat: int) -> float:
    """Median milliseconds per call: `calls` (each run once per round) captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (module loading, allocator) outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for call in calls:
                call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeat):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples) / (rounds * len(calls))


# ---------------------------------------------------------------------------
# Ceilings


def copy_bandwidth_gbs(args) -> float:
    """The best of a plain device-to-device copy and a copy kernel, timed eagerly
    (a memcpy captured in a CUDA graph can run on a copy engine, slower than the
    SMs): bytes read plus bytes written over time."""
    n = (4 << 30) // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    best_ms = float("inf")
    for copy in (lambda: dst.copy_(src), lambda: torch.mul(src, 1.0, out=dst)):
        copy()
        torch.cuda.synchronize()
        samples = []
        for _ in range(max(5, args.repeat // 4)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            copy()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        best_ms = min(best_ms, statistics.median(samples))
    return 2 * n * 4 / (best_ms * 1e-3) / 1e9


def matmul_tflops(args) -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_per_call_ms([lambda: torch.matmul(a, b)], rounds=3, repeat=args.repeat)
    return 2 * n**3 / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------
# Attention


class PagedProblem:
    """Rows of one query token (decode) or one long prompt (prefill) over a paged bf16 cache.

    `copies` disjoint block-table variants cover different regions of the pool,
    so consecutive launches do not find their keys in L2. `lens`: each row's
    context (default: seq_len for every row).
    """

    def __init__(self, num_rows, q_len, seq_len, hq=32, hkv=8, head_dim=128, block_size=16, copies=1,
                 dtype=torch.bfloat16, window=0, lens=None):
        self.num_rows, self.q_len, self.seq_len, self.window = num_rows, q_len, seq_len, window
        self.lens = [seq_len] * num_rows if lens is None else lens
        self.hq, self.hkv, self.head_dim = hq, hkv, head_dim
        blocks_per_row = math.ceil(seq_len / block_size)
        blocks_per_copy = num_rows * blocks_per_row
        num_blocks = blocks_per_copy * copies
        shape = (num_blocks, hkv, block_size, head_dim)
        self.key_cache = torch.randn(shape, device="cuda", dtype=dtype)
        self.value_cache = torch.randn(shape, device="cuda", dtype=dtype)
        perm = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)  # scattered, like a busy pool
        self.tables = [perm[c * blocks_per_copy:(c + 1) * blocks_per_copy].view(num_rows, blocks_per_row)
                       for c in range(copies)]
        self.num_tokens = num_rows * q_len
        self.query = torch.randn(self.num_tokens, hq, head_dim, device="cuda", dtype=dtype)
        self.out = torch.empty_like(self.query)
        self.query_start_loc = torch.arange(0, self.num_tokens + 1, q_len, device="cuda", dtype=torch.int32)
        self.seq_lens = torch.tensor(self.lens, device="cuda", dtype=torch.int32)
        self.num_decodes = num_rows if q_len == 1 else 0
        # Sized like the engine's: for its max_num_seqs rows (256), so small batches may split finer.
        nbytes = _core.cuda_ops.paged_attention_workspace_bytes(max(256, self.num_decodes), hq, head_dim, seq_len)
        self.workspace = torch.empty(max(1, math.ceil(nbytes / 4)), device="cuda", dtype=torch.float32)

    def calls(self, decode_order=None):
        def run(table):
            cuda_op("paged_attention", self.out, self.query, self.key_cache, self.value_cache, table,
                    self.query_start_loc, self.seq_lens, self.head_dim**-0.5, self.q_len, self.seq_len,
                    self.num_decodes, self.workspace, self.window, 0.0, decode_order=decode_order)
        return [lambda t=t: run(t) for t in self.tables]

    def kv_bytes(self):  # a sliding window reads only its last `window` keys per decode row
        windowed = self.window and self.q_len == 1
        tokens = sum(min(n, self.window) if windowed else n for n in self.lens)
        return 2 * tokens * self.hkv * self.head_dim * self.key_cache.element_size()

    def io_bytes(self):  # K/V + Q read, out written
        return self.kv_bytes() + 2 * self.query.numel() * self.query.element_size()

    def causal_flops(self):
        return 4 * self.seq_len**2 / 2 * self.head_dim * self.hq * self.num_rows


def decode_case(batch, context, args, window=0):
    copies = max(1, math.ceil(ROTATE_BYTES / (2 * batch * context * 8 * 128 * 2)))
    problem = PagedProblem(batch, 1, context, copies=min(copies, 64), window=window)
    ms = time_per_call_ms(problem.calls(), rounds=max(1, 8 // len(problem.tables)), repeat=args.repeat)
    gbs = problem.io_bytes() / (ms * 1e-3) / 1e9
    return {"batch": batch, "context": context, "window": window, "ms": ms, "gb_per_s": gbs}


def mixed_decode_cases(batch, shortest, longest, args):
    """Decode rows of random contexts in [shortest, longest] (Qwen3-0.6B's 16 / 8 heads, D 128): launched in
    row order, then longest first (the runner's decode_order). The same bytes either way."""
    lens = torch.randint(shortest, longest + 1, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
    copies = max(1, math.ceil(ROTATE_BYTES / (2 * sum(lens) * 8 * 128 * 2)))
    problem = PagedProblem(batch, 1, longest, hq=16, copies=min(copies, 64), lens=lens)
    longest_first = torch.argsort(problem.seq_lens, descending=True, stable=True).int()
    rows = []
    for order, decode_order in (("row order", None), ("longest first", longest_first)):
        ms = time_per_call_ms(problem.calls(decode_order), rounds=max(1, 8 // len(problem.tables)),
                              repeat=args.repeat)
        rows.append({"batch": batch, "contexts": f"{shortest}..{longest}", "order": order, "ms": ms,
                     "gb_per_s": problem.io_bytes() / (ms * 1e-3) / 1e9})
    return rows


def prefill_case(seq_len, args):
    problem = PagedProblem(1, seq_len, seq_len)
    ms = time_per_call_ms(problem.calls(), rounds=3, repeat=args.repeat)
    return {"seq_len": seq_len, "ms": ms, "tflops": problem.causal_flops() / (ms * 1e-3) / 1e12}


# ---------------------------------------------------------------------------
# Small fused ops at TinyLlama-1.1B shapes, against eager torch


def torch_rms_norm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def torch_rotary(positions, query, key, cos_sin):
    half = cos_sin.shape[1] // 2
    cos, sin = cos_sin[positions.long()].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x):
        x1, x2 = x[..., :half].float(), x[..., half:2 * half].float()
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    query.copy_(rotate(query))
    key.copy_(rotate(key))


def small_op_pairs(tokens):
    """(ours, torch eager) callables per op, on fresh TinyLlama-1.1B-shaped bf16 inputs of `tokens` tokens."""
    hidden, hq, hkv, head_dim, inter, eps = 2048, 32, 4, 64, 5632, 1e-5
    dtype = torch.bfloat16
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device="cuda", dtype=dtype)
    out = torch.empty_like(x)
    gate_up = torch.randn(tokens, 2 * inter, device="cuda", dtype=dtype)
    act = torch.empty(tokens, inter, device="cuda", dtype=dtype)
    query = torch.randn(tokens, hq, head_dim, device="cuda", dtype=dtype)
    key = torch.randn(tokens, hkv, head_dim, device="cuda", dtype=dtype)
    value = torch.randn_like(key)
    positions = torch.randint(0, 2048, (tokens,), device="cuda", dtype=torch.int32)
    inv_freq = 10000.0 ** (-torch.arange(0, head_dim // 2, device="cuda", dtype=torch.float64) * 2 / head_dim)
    angles = torch.arange(2048, device="cuda", dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).float()
    num_blocks, block_size = 4096, 16
    key_cache = torch.zeros(num_blocks, hkv, block_size, head_dim, device="cuda", dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:tokens].to(torch.int32)
    blocks, offsets = (slots // block_size).long(), (slots % block_size).long()

    def torch_cache():
        key_cache[blocks, :, offsets] = key
        value_cache[blocks, :, offsets] = value

    def torch_fused():
        residual.add_(x)
        x.copy_(torch_rms_norm(residual, weight, eps))

    return {
        "rms_norm": (lambda: cuda_op("rms_norm", out, x, weight, eps),
                     lambda: out.copy_(torch_rms_norm(x, weight, eps))),
        "fused_add_rms_norm": (lambda: cuda_op("fused_add_rms_norm", x, residual, weight, eps), torch_fused),
        "rotary_embedding": (lambda: cuda_op("rotary_embedding", positions, query, key, cos_sin),
                             lambda: torch_rotary(positions, query, key, cos_sin)),
        "silu_and_mul": (lambda: cuda_op("silu_and_mul", act, gate_up),
                         lambda: act.copy_(torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:])),
        "reshape_and_cache": (lambda: cuda_op("reshape_and_cache", key, value, key_cache, value_cache, slots),
                              torch_cache),
    }


def small_op_cases(args):
    rows = []
    for tokens in (1, 32, 64, 2048):
        for name, (ours, theirs) in small_op_pairs(tokens).items():
            ours_us = 1e3 * time_per_call_ms([ours], rounds=50, repeat=args.repeat)
            torch_us = 1e3 * time_per_call_ms([theirs], rounds=50, repeat=args.repeat)
            rows.append({"op": name, "tokens": tokens, "ours_us": ours_us, "torch_us": torch_us,
                         "speedup": torch_us / ours_us})
    return rows


# ---------------------------------------------------------------------------
# Report


def table(title: str, columns: list[str], cells: list[list[str]]) -> list[str]:
    """A markdown section: a heading, then a table of preformatted cells."""
    return ["", f"## {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(row) + " |" for row in cells)]


def target_line(what: str, target: dict, measure: str, needs: float) -> list[str]:
    return ["", f"Target ({what}): {100 * target['fraction']:.1f} % of {measure}, needs >= {100 * needs:.0f} %: "
                f"**{'PASS' if target['pass'] else 'FAIL'}**"]


def markdown(results) -> str:
    lines = ["# Kernel benchmark", "", "| ceiling | value |", "|---|---|",
             f"| device-to-device copy | {results['copy_gb_per_s']:.0f} GB/s |",
             f"| bf16 matmul 8192^3 | {results['matmul_tflops']:.0f} TFLOP/s |"]
    lines += table("Decode attention (32 q / 8 kv heads, D 128, bf16, block 16)",
                   ["batch", "context", "time (ms)", "GB/s", "% of copy"],
                   [[str(r["batch"]), str(r["context"]), f"{r['ms']:.4f}", f"{r['gb_per_s']:.0f}",
                     f"{100 * r['fraction_of_copy']:.1f} %"] for r in results["decode_sweep"]])
    lines += target_line("64 x 4096", results["decode_target"], "copy bandwidth", DECODE_TARGET)
    lines += table("Decode attention, mixed contexts (16 q / 8 kv heads, D 128, bf16, block 16)",
                   ["batch", "contexts", "launch order", "time (ms)", "GB/s", "% of copy"],
                   [[str(r["batch"]), r["contexts"], r["order"], f"{r['ms']:.4f}", f"{r['gb_per_s']:.0f}",
                     f"{100 * r['fraction_of_copy']:.1f} %"] for r in results["decode_mixed"]])
    lines += prefill_section(results)
    lines += table("Small fused ops, TinyLlama-1.1B shapes (bf16)", ["op", "tokens", "ours (us)", "torch eager (us)",
                                                                   "speedup"],
                   [[r["op"], str(r["tokens"]), f"{r['ours_us']:.2f}", f"{r['torch_us']:.2f}", f"{r['speedup']:.1f}x"]
                    for r in results["small_ops"]])
    return "\n".join(lines) + "\n"


def prefill_section(results) -> list[str]:
    rows = [[str(r["seq_len"]), f"{r['ms']:.3f}", f"{r['tflops']:.0f}", f"{100 * r['fraction_of_matmul']:.1f} %"]
            for r in results["prefill"]]
    return (table(f"Prefill attention (one causal prompt, 32 q / 8 kv heads, D 128, bf16; {results['prefill_kernel']}"
                  " kernel)", ["tokens", "time (ms)", "TFLOP/s", "% of matmul"], rows)
            + target_line("4096 tokens", results["prefill_target"], "the matmul rate", PREFILL_TARGET))


def main():
    parser = arg_parser(__doc__, "fewer repetitions and a smaller sweep")
    parser.add_argument("--prefill-only", action="store_true", help="the matmul rate and the prefill kernel alone")
    args = parser.parse_args()
    args.repeat = 5 if args.quick else 20
    require_cuda(__file__)
    torch.manual_seed(0)

    results = {}
    if args.prefill_only:
        results["matmul_tflops"] = matmul_tflops(args)
        print(f"bf16 matmul {results['matmul_tflops']:.0f} TFLOP/s", flush=True)
        results.update(prefill_results(results["matmul_tflops"], args))
        report = "\n".join(prefill_section(results)) + "\n"
        print(report)
        print(f"saved {save('kernel_bench_prefill', results, report, args.out)}")
        return
    results["copy_gb_per_s"] = copy_bandwidth_gbs(args)
    results["matmul_tflops"] = matmul_tflops(args)
    print(f"copy {results['copy_gb_per_s']:.0f} GB/s, bf16 matmul {results['matmul_tflops']:.0f} TFLOP/s", flush=True)

    batches = (1, 8, 64) if args.quick else (1, 8, 32, 64, 128)
    contexts = (512, 4096) if args.quick else (512, 1024, 4096, 8192)
    sweep = []
    for batch in batches:
        for context in contexts:
            row = decode_case(batch, context, args)
            row["fraction_of_copy"] = row["gb_per_s"] / results["copy_gb_per_s"]
            sweep.append(row)
            print(f"decode {batch:4d} x {context:5d}: {row['ms']:.4f} ms  {row['gb_per_s']:6.0f} GB/s  "
                  f"{100 * row['fraction_of_copy']:5.1f} % of copy", flush=True)
    results["decode_sweep"] = sweep
    # A sliding window reads only its window: time and bandwidth should scale with it, not the context.
    results["decode_window"] = [decode_case(64, 8192, args, window=w) for w in (4096, 1024)]
    for row in results["decode_window"]:
        print(f"decode   64 x  8192, window {row['window']:5d}: {row['ms']:.4f} ms  {row['gb_per_s']:6.0f} GB/s",
              flush=True)
    mixed = []
    for batch, shortest, longest in ((256, 100, 2048), (128, 600, 2048), (64, 1000, 2048)):
        for row in mixed_decode_cases(batch, shortest, longest, args):
            row["fraction_of_copy"] = row["gb_per_s"] / results["copy_gb_per_s"]
            mixed.append(row)
            print(f"decode {batch:4d} x {row['contexts']}, {row['order']:13s}: {row['ms']:.4f} ms  "
                  f"{row['gb_per_s']:6.0f} GB/s  {100 * row['fraction_of_copy']:5.1f} % of copy", flush=True)
    results["decode_mixed"] = mixed
    target = decode_case(64, 4096, args)
    fraction = target["gb_per_s"] / results["copy_gb_per_s"]
    results["decode_target"] = {**target, "fraction": fraction, "pass": fraction >= DECODE_TARGET}

    results.update(prefill_results(results["matmul_tflops"], args))
    results["small_ops"] = small_op_cases(args)
    report = markdown(results)
    print(report)
    path = save("kernel_bench" + ("_quick" if args.quick else ""), results, report, args.out)
    print(f"saved {path}")


def prefill_results(matmul_tflops, args):
    kernel = _core.cuda_ops.prefill_attention_kernel(128)
    print(f"prefill kernel (head dim 128): {kernel}", flush=True)
    prefill = []
    for seq_len in (512, 1024, 2048, 4096):
        row = prefill_case(seq_len, args)
        row["fraction_of_matmul"] = row["tflops"] / matmul_tflops
        prefill.append(row)
        print(f"prefill {seq_len:5d}: {row['ms']:.3f} ms  {row['tflops']:5.0f} TFLOP/s  "
              f"{100 * row['fraction_of_matmul']:5.1f} % of matmul", flush=True)
    fraction = prefill[-1]["fraction_of_matmul"]
    return {"prefill_kernel": kernel, "prefill": prefill,
            "prefill_target": {**prefill[-1], "fraction": fraction, "pass": fraction >= PREFILL_TARGET}}


if __name__ == "__main__":
    main()
