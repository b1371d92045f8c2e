"""Where a decode step's time goes on a GPU: device time of the step's work
(block copies, forward or graph replay, logits, sampling: CUDA events around it)
against the wall time of a whole engine step. Host work the engine does not
overlap with the device shows as wall minus device.

    python bench/perf/step_timing.py --shape tinyllama-1.1b --batch 64     (needs a CUDA GPU and the CUDA build)
    python bench/perf/step_timing.py --quick                               # batches 1 and 8, 10 steps
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.model_shapes import shape_dir  # noqa: E402
from common.report import add_engine_options, arg_parser, engine_options, markdown_table, require_cuda, save  # noqa: E402


def measure(shape: str | None, batch: int, steps: int, options: dict | None = None) -> dict:
    """Median wall and device ms of a decode step; options: more LLMEngine keyword options."""
    from pagedserve import LLMEngine, SamplingParams
    from pagedserve.models.default_model import default_model_dir
    model_dir, load_format = (shape_dir(shape), "dummy") if shape else (default_model_dir(), "auto")
    engine = LLMEngine(model=str(model_dir), load_format=load_format, dtype="bfloat16", device="cuda",
                       max_num_seqs=max(batch, 8), max_model_len=1024, **(options or {}))
    worker = engine.worker
    device_ms: list[float] = []
    launch = worker.execute_async

    def timed_launch(step, rows, *rest):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        pending = launch(step, rows, *rest)
        end.record()
        timed_launch.events.append((start, end, step.num_decodes == step.num_seqs))
        return pending
    timed_launch.events = []
    worker.execute_async = timed_launch
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), {"prompt_token_ids": [100 + i + j for j in range(24)]}, params, stream=False)
    for _ in range(4):  # prefill and warm up
        engine.step()
    timed_launch.events.clear()
    wall = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        wall.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    device_ms = [s.elapsed_time(e) for s, e, decode in timed_launch.events if decode]
    engine.shutdown()
    wall_ms, gpu_ms = statistics.median(wall), statistics.median(device_ms)
    return {"model": shape or model_dir.name, "batch": batch, "wall_ms_per_step": wall_ms,
            "device_ms_per_step": gpu_ms, "host_not_overlapped_ms": max(0.0, wall_ms - gpu_ms),
            "host_share_of_device_time": max(0.0, wall_ms - gpu_ms) / gpu_ms}


def main() -> None:
    ap = arg_parser(__doc__, "small batches and few steps: checks the script works")
    ap.add_argument("--shape", default="tinyllama-1.1b", help="dummy shape, or 'default' for SmolLM2-135M")
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="default 1 64 256 (--quick: 1 8)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps timed per batch (default 100, --quick: 10)")
    add_engine_options(ap)
    args = ap.parse_args()
    args.batch = args.batch or ([1, 8] if args.quick else [1, 64, 256])
    args.steps = args.steps or (10 if args.quick else 100)
    require_cuda(__file__)
    shape = None if args.shape == "default" else args.shape
    options = engine_options(args.option)
    rows = [measure(shape, b, args.steps, options) for b in args.batch]
    table = markdown_table(rows, list(rows[0]))
    print(table)
    variant = "".join(f"_{key}-{value}" for key, value in options.items())
    save(f"step_timing_{args.shape}{variant}" + ("_quick" if args.quick else ""), {"rows": rows, "options": options},
         "## Decode step: wall time vs device time\n\n" + table, args.out)


if __name__ == "__main__":
    main()
