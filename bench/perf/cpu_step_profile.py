"""Where a batch-1 CPU decode step's time goes, per CPU mode: ms per token, and the calls into C++ that take it.

Random weights of a model shape (default: the default model's), one engine per mode side by side, rounds
interleaved; then a cProfile of one more generate per mode, whose C++ calls (their own time, DLPack conversion
included) are reported per token. The fused modes show the decoder stack's one call and the LM head; the
*_perop modes (cpu_fused_layers=False) split the same step into its op calls, so the linears' share reads
directly. Pin the process to measure a 2-core machine (pagedserve's pool takes every core it may).

    taskset -c 0,1 python bench/perf/cpu_step_profile.py [--tokens 64] [--rounds 2]
    python bench/perf/cpu_step_profile.py --quick      # the int8 modes, 4 tokens, 1 round: checks the script works
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.model_shapes import random_bf16_options, shape_dir  # noqa: E402
from common.report import arg_parser, markdown_table, save  # noqa: E402

MODES = {"bfloat16": dict(cpu_precision="bfloat16"),
         "int8": dict(quantization="int8"),
         "float32": dict(cpu_precision="float32"),
         "bfloat16_perop": dict(cpu_precision="bfloat16", cpu_fused_layers=False),
         "int8_perop": dict(quantization="int8", cpu_fused_layers=False)}
QUICK_MODES = ("int8", "int8_perop")
TOP_CALLS = 6  # C++ calls reported per mode


def cxx_calls(profile: cProfile.Profile, tokens: int) -> list[dict]:
    """The profile's built-in calls into pagedserve._core, most own time first, per token, and the fused
    stack's whole call (its time including the C++ forward, which cProfile lists on its own only where the
    interpreter reports pybind11 methods as C calls: Python 3.11 does, 3.12 did not on the AMX host)."""
    rows = []
    for (file, _, name), (_, calls, own, total, _) in pstats.Stats(profile).stats.items():
        if name.startswith("<built-in method pagedserve._core"):
            rows.append({"call": name.removeprefix("<built-in method pagedserve._core.").rstrip(">"),
                         "calls_per_token": calls / tokens, "ms_per_token": own / tokens * 1e3})
        elif file.endswith("fused_layers.py") and name == "__call__":
            rows.append({"call": "FusedDecoderStack.__call__ (whole)", "calls_per_token": calls / tokens,
                         "ms_per_token": total / tokens * 1e3})
    return sorted(rows, key=lambda r: -r["ms_per_token"])[:TOP_CALLS]


def main() -> None:
    ap = arg_parser(__doc__, "the int8 modes, 4 tokens, 1 round: checks the script works")
    ap.add_argument("--shape", default="smollm2-135m", help="model shape (bench/common/model_shapes.py)")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens a generate (one sequence)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from pagedserve import LLM, SamplingParams, ops

    tokens, rounds = (4, 1) if args.quick else (args.tokens, args.rounds)
    modes = {m: MODES[m] for m in QUICK_MODES} if args.quick else MODES
    engines = {mode: LLM(str(shape_dir(args.shape)), device="cpu", load_format="dummy", max_num_seqs=4,
                         max_model_len=256, enable_prefix_caching=False, **random_bf16_options(options))
               for mode, options in modes.items()}
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(100, 124))}]

    def generate(llm) -> float:
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        return (time.perf_counter() - start) / tokens * 1e3

    for llm in engines.values():
        generate(llm)  # warm-up
    ms = {mode: [] for mode in engines}
    for _ in range(rounds):
        for mode, llm in engines.items():
            ms[mode].append(generate(llm))
    summary, calls = [], []
    for mode, llm in engines.items():
        profile = cProfile.Profile()
        profile.enable()
        llm.generate(prompt, params, use_tqdm=False)
        profile.disable()
        summary.append({"mode": mode, "median_ms_per_token": statistics.median(ms[mode]),
                        "rounds_ms_per_token": ms[mode]})
        calls += [{"mode": mode, **row} for row in cxx_calls(profile, tokens)]
    for row in summary + calls:
        print(row)
    markdown = "\n".join([
        f"## Batch-1 decode on CPU, {args.shape} shape, random weights: {tokens} tokens a generate, "
        f"{rounds} interleaved rounds (ops ISA {ops.cpu_isa()}, {ops.num_threads()} threads)", "",
        markdown_table(summary, ["mode", "median_ms_per_token"]), "",
        "Calls into C++ of one profiled generate (own time, per token):", "",
        markdown_table(calls, ["mode", "call", "calls_per_token", "ms_per_token"])])
    name = f"cpu_step_profile_{args.shape}" + ("_quick" if args.quick else "")
    payload = {"shape": args.shape, "tokens": tokens, "rounds": rounds, "ops_isa": ops.cpu_isa(),
               "summary": summary, "calls": calls}
    print(f"saved {save(name, payload, markdown, args.out)}")


if __name__ == "__main__":
    main()
