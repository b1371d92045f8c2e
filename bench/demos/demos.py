"""Demos of what paging and continuous batching buy, one subcommand each; every
one prints a table or picture and saves JSON + markdown (bench/results/demo_*).

    python bench/demos/demos.py waste               # static batch: decode steps needed vs spent
    python bench/demos/demos.py latency             # completion times, static vs continuous, at most 4 running
    python bench/demos/demos.py block-table         # block tables and a map of the pool (no model)
    python bench/demos/demos.py prefix-sharing      # shared system prompt: hit rate, blocks saved, TTFT
    python bench/demos/demos.py parallel-sampling   # n = 4: fork + copy-on-write vs four requests
    python bench/demos/demos.py preemption          # a small KV pool: preemptions, same greedy outputs
    python bench/demos/demos.py all --quick         # every demo at tiny sizes (CI)

Engine demos take --device / --model / --shape / --dtype (default: SmolLM2-135M-Instruct,
float32 on CPU, bfloat16 on CUDA); `python bench/demos/demos.py NAME --help` lists each one's options.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _demos import block_table, latency, parallel_sampling, preemption, prefix_sharing, waste  # noqa: E402
from common.report import save  # noqa: E402

DEMOS = {"waste": waste, "latency": latency, "block-table": block_table, "prefix-sharing": prefix_sharing,
         "parallel-sampling": parallel_sampling, "preemption": preemption}


def add_common(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks that the demo works")
    ap.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="demo", required=True, metavar="DEMO")
    for name, module in DEMOS.items():
        p = sub.add_parser(name, help=module.__doc__.splitlines()[0], description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        add_common(p)
    p = sub.add_parser("all", help="every demo in turn, with each one's defaults")
    from _demos.common import add_engine_args
    add_engine_args(p)
    add_common(p)
    return ap.parse_args(argv)


def run_one(name: str, args: argparse.Namespace) -> list[str]:
    """Runs and saves one demo; returns the checks it failed (in its saved payload too)."""
    module = DEMOS[name]
    # Each demo's own defaults, then the shared options given on the command line.
    demo_args = parse_args([name])
    for key, value in vars(args).items():
        if hasattr(demo_args, key) and key != "demo":
            setattr(demo_args, key, value)
    result_name, payload, md = module.run(demo_args)
    print(md, flush=True)
    if demo_args.quick:
        result_name += "_quick"
    payload = {"demo": name, "quick": demo_args.quick, "device": getattr(demo_args, "device", None), **payload}
    path = save(result_name, payload, md, demo_args.out)
    print(f"saved {path}\n", flush=True)
    return [f"{name}: {failure}" for failure in payload.get("failures", [])]


def main() -> None:
    args = parse_args()
    failures = []
    for name in list(DEMOS) if args.demo == "all" else [args.demo]:
        failures += run_one(name, args)
    if failures:
        raise SystemExit("failed checks:\n  " + "\n  ".join(failures))


if __name__ == "__main__":
    main()
