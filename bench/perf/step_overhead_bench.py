"""The per-step fixed cost on a CPU: milliseconds per decode step with every decoder layer as one C++ call
(cpu_fused_layers, models/fused_layers.py) against the per-op path (about eleven op calls per layer), and
how many Python -> C++ calls a decode step makes either way.

Both engines live side by side over the same model and prompts; rounds alternate which goes first, so a
busy machine slows both alike. Each round times `--steps` decode steps of every engine; the figures are
the median and the minimum over rounds of each round's median step.

    python bench/perf/step_overhead_bench.py                 # SmolLM2-135M, batch 1 and 16, 7 rounds
    python bench/perf/step_overhead_bench.py --quick         # batch 1, 2 rounds of 8 steps
    python bench/perf/step_overhead_bench.py --shape qwen3-0.6b --batch 1 4   # dummy bf16 weights
    python bench/perf/step_overhead_bench.py --quantization int8 --batch 1 4 16 64   # int8 channels
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.model_shapes import shape_dir  # noqa: E402
from common.report import arg_parser, markdown_table, save  # noqa: E402

PROMPT_LEN = 24
WARMUP_STEPS = 4  # the prefill, then decodes until the pools and allocator settle
COUNTED_STEPS = 4  # decode steps run under cProfile to count calls


def make_engine(shape: str, batch: int, fused: bool, total_steps: int, quantization: str = "none"):
    from pagedserve import LLMEngine, SamplingParams
    from pagedserve.models.default_model import default_model_dir

    model, load_format, weights = ((default_model_dir(), "auto", "auto") if shape == "default"
                                   else (shape_dir(shape), "dummy", "bfloat16"))  # dummy weights: pack anyway
    engine = LLMEngine(model=str(model), load_format=load_format, device="cpu", cpu_weight_dtype=weights,
                       cpu_fused_layers=fused, max_num_seqs=max(batch, 8), max_model_len=1024,
                       kv_cache_memory_gb=0.25, quantization=quantization)
    if (engine.worker.model.model.fused is not None) is not fused:
        raise SystemExit(f"cpu_fused_layers={fused} did not take effect for {shape} (see the log for why)")
    params = SamplingParams(temperature=0.0, max_tokens=total_steps + 16, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), {"prompt_token_ids": [100 + i + j for j in range(PROMPT_LEN)]}, params,
                           stream=False)
    for _ in range(WARMUP_STEPS):
        engine.step()
    return engine


def timed_steps(engine, steps: int) -> float:
    """The median wall time of `steps` engine steps, in ms."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def calls_per_step(engine) -> dict:
    """Python -> C++ calls per decode step: into pagedserve._core (ops and scheduler) and into any C function."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(COUNTED_STEPS):
        engine.step()
    profile.disable()
    stats = pstats.Stats(profile).stats
    builtin = {name: calls for (file, _, name), (_, calls, *_rest) in stats.items() if file == "~"}
    core = sum(n for name, n in builtin.items() if "pagedserve._core" in name)
    ops = sum(n for name, n in builtin.items() if "pagedserve._core.ops" in name)
    return {"core_calls": core / COUNTED_STEPS, "op_calls": ops / COUNTED_STEPS,
            "c_calls": sum(builtin.values()) / COUNTED_STEPS}


def measure(shape: str, batch: int, rounds: int, steps: int, quantization: str = "none") -> list[dict]:
    total = rounds * steps + COUNTED_STEPS + 8
    engines = {path: make_engine(shape, batch, path == "fused", total, quantization) for path in ("fused", "per-op")}
    per_round: dict[str, list[float]] = {mode: [] for mode in engines}
    for r in range(rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for mode in order:
            per_round[mode].append(timed_steps(engines[mode], steps))
    rows = []
    for mode, engine in engines.items():
        ms = statistics.median(per_round[mode])
        rows.append({"model": shape, "quantization": quantization, "batch": batch, "path": mode, "ms_per_step": ms,
                     "min_ms_per_step": min(per_round[mode]), "tok_per_s": batch * 1e3 / ms,
                     **calls_per_step(engine), "rounds_ms": per_round[mode]})
        engine.shutdown()
    fused, per_op = rows
    fused["speedup"] = per_op["ms_per_step"] / fused["ms_per_step"]
    per_op["speedup"] = 1.0
    return rows


def main() -> None:
    ap = arg_parser(__doc__, "batch 1 only, 2 rounds of 8 steps: checks the script works")
    ap.add_argument("--shape", default="default", help="'default' (SmolLM2-135M) or a dummy shape of "
                                                       "bench/common/model_shapes.py")
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="default 1 16 (--quick: 1)")
    ap.add_argument("--rounds", type=int, default=None, help="default 7 (--quick: 2)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps per engine per round (default 32, "
                                                            "--quick: 8)")
    ap.add_argument("--quantization", default="none", choices=("none", "int8"), help="the weights' format "
                                                                                     "(EngineConfig.quantization)")
    args = ap.parse_args()
    batches = args.batch or ([1] if args.quick else [1, 16])
    rounds = args.rounds or (2 if args.quick else 7)
    steps = args.steps or (8 if args.quick else 32)
    rows = [row for batch in batches for row in measure(args.shape, batch, rounds, steps, args.quantization)]
    columns = ["model", "quantization", "batch", "path", "ms_per_step", "min_ms_per_step", "tok_per_s", "speedup",
               "core_calls", "op_calls", "c_calls"]
    table = markdown_table(rows, columns)
    print(table)
    suffix = ("" if args.quantization == "none" else f"_{args.quantization}") + ("_quick" if args.quick else "")
    save(f"step_overhead_{args.shape}" + suffix,
         {"rounds": rounds, "steps_per_round": steps, "rows": rows},
         "## CPU decode step: every layer in one C++ call vs per-op\n\n"
         f"{rounds} interleaved rounds of {steps} decode steps per engine; ms_per_step: median over rounds of "
         "each round's median step; core_calls / op_calls: Python -> pagedserve._core (all / ops) calls per "
         "decode step; c_calls: calls into any C function.\n\n" + table, args.out)


if __name__ == "__main__":
    main()
