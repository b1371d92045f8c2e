"""Cost of one scheduler step (schedule + update) at 64, 256 and 1024 running
decoding sequences, in C++ (bench/perf/scheduler_step_bench.cc, built with
CMake on first use) and through the Python bindings (including reading the
step's arrays as a runner does).

    python bench/perf/scheduler_bench.py [--sizes 64 256 1024] [--out DIR]
    python bench/perf/scheduler_bench.py --quick         # 64 sequences only
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.report import arg_parser, markdown_table, save  # noqa: E402

from pagedserve import _core  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROMPT_LEN, BLOCK_SIZE, STEPS = 128, 16, 512


def cpp_bench_binary() -> Path:
    for candidate in sorted(ROOT.glob("build/*/scheduler_step_bench")):
        return candidate
    build = ROOT / "build" / "bench"
    subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    "-DPAGEDSERVE_BUILD_PYTHON=OFF", "-DPAGEDSERVE_BUILD_TESTS=ON"], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--target", "scheduler_step_bench", "-j"], check=True,
                   stdout=subprocess.DEVNULL)
    return build / "scheduler_step_bench"


def python_bench(num_seqs: int) -> dict:
    cfg = _core.SchedulerConfig(num_blocks=num_seqs * ((PROMPT_LEN + STEPS + 64) // BLOCK_SIZE + 2),
                                block_size=BLOCK_SIZE, max_num_seqs=num_seqs,
                                max_num_batched_tokens=max(num_seqs, 8192), max_model_len=4096, eos_token_ids=[2])
    s = _core.Scheduler(cfg)
    for i in range(num_seqs):
        s.add_sequence(np.arange(PROMPT_LEN, dtype=np.int32) + 1000 + 7 * i, max_tokens=100000)
    while True:  # prefill everyone
        out = s.schedule()
        s.update(np.full(out.total_samples, 5, dtype=np.int32))
        if out.num_decodes == num_seqs:
            break
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        out = s.schedule()
        # What a runner reads each step.
        arrays = (out.input_ids, out.positions, out.slot_mapping, out.query_start_loc, out.seq_lens,
                  out.block_tables, out.logits_indices)
        s.update(np.full(out.total_samples, 5, dtype=np.int32))
        times.append((time.perf_counter() - t0) * 1e6)
        assert arrays[0].shape[0] == num_seqs
    return {"num_seqs": num_seqs, "python_step_us": statistics.median(times)}


def main() -> None:
    ap = arg_parser(__doc__, "64 sequences only: checks the script works")
    ap.add_argument("--sizes", type=int, nargs="+", default=None, help="running sequences (default 64 256 1024)")
    args = ap.parse_args()
    args.sizes = args.sizes or ([64] if args.quick else [64, 256, 1024])
    binary = cpp_bench_binary()
    cpp = [json.loads(line) for line in
           subprocess.run([str(binary), *map(str, args.sizes)], check=True, capture_output=True,
                          text=True).stdout.splitlines()]
    rows = []
    for c in cpp:
        py = python_bench(c["num_seqs"])
        rows.append({"num_seqs": c["num_seqs"], "cpp_schedule_us": c["schedule_us"], "cpp_update_us": c["update_us"],
                     "cpp_step_us": c["step_us"], "python_step_us": py["python_step_us"],
                     "binding_overhead_us": py["python_step_us"] - c["step_us"],
                     "meets_20us_at_256": (c["step_us"] <= 20.0) if c["num_seqs"] == 256 else ""})
    cols = ["num_seqs", "cpp_schedule_us", "cpp_update_us", "cpp_step_us", "python_step_us", "binding_overhead_us",
            "meets_20us_at_256"]
    table = markdown_table(rows, cols)
    print(table)
    md = ("## Scheduler step cost (decode steps, median over %d steps)\n\n" % STEPS) + table
    path = save("scheduler" + ("_quick" if args.quick else ""),
                {"prompt_len": PROMPT_LEN, "block_size": BLOCK_SIZE, "rows": rows}, md, args.out)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
