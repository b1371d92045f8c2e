"""Kernels per decode step on a GPU: how many the step launches and where its device time goes.

A single-stream decode step is launch-bound, not bandwidth-bound: TinyLlama-1.1B streams 2.2 GB of
weights per token (0.5 ms at an H200's 4.3 TB/s copy rate) yet took 1.33 ms of device time. This
script profiles eager decode steps (no CUDA graph, so every launch is visible to the profiler) and
counts the kernels of one step (forward, logits, sampling), grouped by kernel, with their device time;
then times the same step as the engine runs it (CUDA graphs on) with CUDA events, and puts both beside
the weight-streaming floor (parameter bytes over the measured copy bandwidth).

    python bench/perf/decode_kernels.py --shape tinyllama-1.1b --batch 1      (needs a CUDA GPU and the CUDA build)
    python bench/perf/decode_kernels.py --quick                               # default model, 3 steps

Prints a table and writes decode_kernels_<shape>.json and .md under --out (default bench/results).
"""

from __future__ import annotations

import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.model_shapes import shape_dir  # noqa: E402
from common.report import add_engine_options, arg_parser, engine_options, markdown_table, require_cuda, save  # noqa: E402
from perf.step_timing import measure  # noqa: E402


def copy_bandwidth_gbs() -> float:
    """Bytes read plus written per second by a 2 GiB device-to-device copy (median of 5)."""
    src = torch.empty((1 << 30) // 2, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    samples = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return 2 * src.numel() * 4 / (statistics.median(samples[1:]) * 1e-3) / 1e9


def kernel_group(name: str) -> str:
    """A short, stable label for a kernel: its function name without templates and arguments."""
    name = re.sub(r"\(anonymous namespace\)::", "", name).replace("void ", "")
    name = re.sub(r"<.*", "", name).split("(")[0].split("::")[-1]
    if "gemv" in name or "gemm" in name or "sm90" in name or "cutlass" in name or "nvjet" in name:
        return "matmul (cuBLAS): " + name[:48]
    return name[:70]


def make_engine(shape: str | None, batch: int, eager: bool, steps: int, options: dict):
    from pagedserve import LLMEngine, SamplingParams
    from pagedserve.models.default_model import default_model_dir
    model_dir, load_format = (shape_dir(shape), "dummy") if shape else (default_model_dir(), "auto")
    engine = LLMEngine(model=str(model_dir), load_format=load_format, dtype="bfloat16", device="cuda",
                       max_num_seqs=max(batch, 8), max_model_len=1024, enforce_eager=eager, **options)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), {"prompt_token_ids": [100 + i + j for j in range(24)]}, params, stream=False)
    for _ in range(4):  # prefill, then warm-up decode steps
        engine.step()
    return engine


def weight_bytes(model) -> int:
    """Bytes of the model's weights: its parameters and the weights its linear kernels hold (a
    --batch-invariant model keeps its matrices in FixedSliceProduct), each storage counted once."""
    tensors = {t.data_ptr(): t for t in model.parameters()}
    kernels = [getattr(m, "kernel", None) for m in model.modules()] + [getattr(model, "lm_head_kernel", None)]
    for kernel in kernels:
        weight = getattr(kernel, "weight", None)
        if isinstance(weight, torch.Tensor):
            tensors[weight.data_ptr()] = weight
    return sum(t.numel() * t.element_size() for t in tensors.values())


def census(shape: str | None, batch: int, steps: int, options: dict) -> tuple[dict, list[dict]]:
    """Kernels and device time per eager decode step, grouped by kernel."""
    from torch.profiler import ProfilerActivity, profile
    engine = make_engine(shape, batch, True, steps, options)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    params = weight_bytes(engine.worker.model)
    engine.shutdown()
    groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA or "Memcpy" in evt.name or "Memset" in evt.name:
            continue
        g = groups[kernel_group(evt.name)]
        g[0] += 1
        g[1] += evt.device_time
    rows = [{"kernel": k, "launches_per_step": n / steps, "device_us_per_step": us / steps}
            for k, (n, us) in sorted(groups.items(), key=lambda kv: -kv[1][1])]
    total = {"kernels_per_step": sum(r["launches_per_step"] for r in rows),
             "kernel_us_per_step": sum(r["device_us_per_step"] for r in rows), "param_bytes": params}
    # Tensor parallel: the collectives' kernels (NCCL's all-reduces; this rank's share of the step).
    total["nccl_share"] = sum(r["device_us_per_step"] for r in rows if "nccl" in r["kernel"].lower()) / \
        max(total["kernel_us_per_step"], 1e-9)
    return total, rows


def graph_step_ms(shape: str | None, batch: int, steps: int, options: dict) -> dict:
    """Device and wall time of a decode step as the engine runs it (CUDA graphs): step_timing.py's measure."""
    timing = measure(shape, batch, steps, options)
    return {"graph_device_ms": timing["device_ms_per_step"], "graph_wall_ms": timing["wall_ms_per_step"]}


def main() -> None:
    ap = arg_parser(__doc__, "default model, batch 1, 3 steps: checks the script works")
    ap.add_argument("--shape", default="tinyllama-1.1b", help="dummy shape, or 'default' for SmolLM2-135M")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--label", default="", help="a tag for this build's variant (e.g. 'unfused')")
    add_engine_options(ap)
    args = ap.parse_args()
    if args.quick:
        args.shape, args.batch, args.steps = "default", [1], 3
    require_cuda(__file__)
    options = engine_options(args.option)
    shape = None if args.shape == "default" else args.shape
    bandwidth = copy_bandwidth_gbs()
    summary, details = [], {}
    for batch in args.batch:
        total, rows = census(shape, batch, args.steps, options)
        timing = graph_step_ms(shape, batch, max(args.steps, 20), options)
        floor_ms = total["param_bytes"] / (bandwidth * 1e9) * 1e3
        summary.append({"model": args.shape, "variant": args.label or "-", "batch": batch, **total,
                        "weight_floor_ms": floor_ms, **timing,
                        "floor_share_of_graph_device": floor_ms / timing["graph_device_ms"]})
        details[batch] = rows
    report = [f"Copy bandwidth {bandwidth:.0f} GB/s (2 GiB device-to-device copy).", "",
              markdown_table(summary, list(summary[0]))]
    for batch, rows in details.items():
        report += ["", f"### Batch {batch}: kernels of one eager decode step", "",
                   markdown_table(rows, ["kernel", "launches_per_step", "device_us_per_step"])]
    text = "\n".join(report)
    print(text)
    name = f"decode_kernels_{args.shape}" + (f"_{args.label}" if args.label else "") + ("_quick" if args.quick else "")
    save(name, {"copy_gb_per_s": bandwidth, "summary": summary, "kernels": details},
         "## Kernels per decode step\n\n" + text, args.out)


if __name__ == "__main__":
    main()
