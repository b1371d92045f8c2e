"""Tensor parallelism on the CPU: the time of a decode step at TP = 1 and TP = 2, and the share of it
the driver spends in collectives (gloo over loopback).

Per TP size and batch: B requests of 16-token prompts, warmed up, then N engine steps timed (median).
At TP = 2 the driver's time inside each kind of collective is summed over the same steps: the
all-reduces of the row-parallel layers and the embedding, the logits gather to the driver, and the
step broadcast. A collective's time includes waiting for the slower rank, so "all-reduce share" is
an upper bound on the wire's cost. Each rank gets half the cores (on 2 cores: one each), so no
speed-up is expected there; the point is the overhead. Beside it, a bare gloo all-reduce between two
fresh processes: the floor each of the step's all-reduces sits on (on this 2-core VM 1.56 ms, where a TCP
loopback round trip takes 58 us: gloo's wake-ups, not the wire).

    python bench/perf/tp_bench.py                   # default model (SmolLM2-135M), batches 1 8 32, 40 steps
    python bench/perf/tp_bench.py --shape tinyllama-1.1b   # dummy weights of a bigger shape
    python bench/perf/tp_bench.py --quick           # batches 1 and 8, 8 steps
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.model_shapes import shape_dir  # noqa: E402
from common.report import arg_parser, markdown_table, save  # noqa: E402

COLLECTIVES = {"all_reduce": "all_reduce", "gather": "gather", "broadcast": "broadcast"}


class CollectiveTimer:
    """Wall time this process spends inside torch.distributed's collectives, by kind, while on."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.on = False
        for name in COLLECTIVES:
            setattr(dist, name, self._timed(name, getattr(dist, name)))

    def _timed(self, name, fn):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1
        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def measure(model_dir: Path, load_format: str, tp: int, batch: int, steps: int, timer: CollectiveTimer) -> dict:
    from pagedserve import LLMEngine, SamplingParams

    engine = LLMEngine(model=str(model_dir), load_format=load_format, dtype="float32", device="cpu",
                       tensor_parallel_size=tp, max_num_seqs=max(batch, 8), max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), {"prompt_token_ids": [100 + i + j for j in range(16)]}, params, stream=False)
    for _ in range(3):  # the prefill and a first decode or two
        engine.step()
    timer.reset()
    timer.on = True
    wall = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        wall.append((time.perf_counter() - start) * 1e3)
    timer.on = False
    engine.shutdown()
    step_ms = statistics.median(wall)
    total_ms = sum(wall)
    row = {"model": model_dir.name, "tp": tp, "batch": batch, "ms_per_step": step_ms}
    for name in COLLECTIVES:
        row[f"{name}_ms_per_step"] = timer.seconds[name] * 1e3 / steps
        row[f"{name}_calls_per_step"] = timer.calls[name] / steps
    row["all_reduce_share"] = timer.seconds["all_reduce"] * 1e3 / total_ms
    row["collective_share"] = sum(timer.seconds.values()) * 1e3 / total_ms
    return row


def _bare_all_reduce(rank: int, port: int, width: int, iterations: int, result) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    import torch
    torch.set_num_threads(1)
    x = torch.zeros(1, width)
    for _ in range(20):
        dist.all_reduce(x)
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(x)
    if rank == 0:
        result.value = (time.perf_counter() - start) / iterations
    dist.destroy_process_group()


def bare_all_reduce_us(width: int, iterations: int) -> float:
    """One gloo all-reduce of [1, width] float32 between two fresh local processes, nothing else running:
    the floor under each of a step's all-reduces on this machine."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    result = context.Value("d", 0.0)
    processes = [context.Process(target=_bare_all_reduce, args=(rank, port, width, iterations, result))
                 for rank in (0, 1)]
    for p in processes:
        p.start()
    for p in processes:
        p.join()
    return result.value * 1e6


def main() -> None:
    ap = arg_parser(__doc__, "batches 1 and 8, 8 steps: checks the script works")
    ap.add_argument("--shape", default="default", help="'default' (SmolLM2-135M) or a dummy shape "
                                                       "(bench/common/model_shapes.py)")
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="default 1 8 32 (--quick: 1 8)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps timed (default 40, --quick: 8)")
    args = ap.parse_args()
    batches = args.batch or ([1, 8] if args.quick else [1, 8, 32])
    steps = args.steps or (8 if args.quick else 40)
    if args.shape == "default":
        from pagedserve.models.default_model import default_model_dir
        model_dir, load_format = default_model_dir(), "auto"
    else:
        model_dir, load_format = shape_dir(args.shape), "dummy"
    timer = CollectiveTimer()
    rows = [measure(model_dir, load_format, tp, b, steps, timer) for tp in (1, 2) for b in batches]
    for row in rows:
        base = next(r for r in rows if r["tp"] == 1 and r["batch"] == row["batch"])
        row["vs_tp1"] = row["ms_per_step"] / base["ms_per_step"]
    columns = ["model", "tp", "batch", "ms_per_step", "vs_tp1", "all_reduce_ms_per_step", "all_reduce_calls_per_step",
               "gather_ms_per_step", "broadcast_ms_per_step", "all_reduce_share", "collective_share"]
    table = markdown_table(rows, columns)
    bare_us = bare_all_reduce_us(576, 50 if args.quick else 500)
    bare = (f"A bare gloo all-reduce of 576 float32 between two local processes with nothing else running: "
            f"{bare_us:.0f} us (the floor under each of the step's all-reduces here).")
    print(table + "\n" + bare)
    save(f"tp_cpu_{args.shape}" + ("_quick" if args.quick else ""),
         {"steps": steps, "rows": rows, "bare_all_reduce_us": bare_us},
         "## Tensor parallelism on the CPU: decode step time, TP = 1 vs TP = 2 (gloo)\n\n"
         "Collective times are the driver's wall time inside them, waiting for the other rank included.\n\n"
         + table + "\n\n" + bare, args.out)


if __name__ == "__main__":
    main()
