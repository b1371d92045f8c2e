"""How long the `pagedserve` command takes to answer: `--help`, a rejected argument, and the first token of
`generate` on the cached default model (wall seconds, each command a fresh process, runs interleaved).

"First token" is when stdout first holds more than the echoed prompt. `--compare DIR` times a second
checkout's python/ (e.g. the previous commit: `git archive HEAD python | tar -x -C /tmp/before`, plus its
built _core extension) in the same interleaved runs, so both see the same machine load.

    PYTHONPATH=python python bench/perf/cli_startup.py [--runs 3] [--compare /tmp/before/python]
    python bench/perf/cli_startup.py --quick     # one run, 2 tokens: checks the script works

Prints a table and writes bench/results/cli_startup.json and .md (cli_startup_quick with --quick).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.report import ROOT, arg_parser, markdown_table, save  # noqa: E402

PROMPT = "The capital of France is"
# (case, argv, whether to time the first token)
CASES = (
    ("--help", ["--help"], False),
    ("generate --help", ["generate", "--help"], False),
    ("generate --max-tokens -1 (rejected)", ["generate", PROMPT, "--max-tokens", "-1"], False),
    ("generate (first token)", ["generate", PROMPT, "--device", "cpu"], True),
)
GOALS = {"--help": 1.0, "generate --help": 1.0, "generate --max-tokens -1 (rejected)": 1.0,
         "generate (first token)": 4.0}


def run_once(pythonpath: Path, argv: list[str], first_token: bool, max_tokens: int) -> dict:
    """Runs the command once; wall seconds to exit and (generate) to the first byte past the prompt."""
    if first_token:
        argv = [*argv, "--max-tokens", str(max_tokens)]
    env = dict(os.environ, PYTHONPATH=str(pythonpath), PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
    out, first = b"", None
    while chunk := os.read(proc.stdout.fileno(), 4096):
        out += chunk
        if first is None and len(out) > len(PROMPT.encode()):
            first = time.perf_counter() - start
    err = proc.stderr.read()
    proc.wait()
    wall = time.perf_counter() - start
    ok = proc.returncode == (0 if first_token or "--help" in argv else 2)
    if not ok:
        print(f"unexpected exit {proc.returncode} from {argv}:\n{err.decode()[-2000:]}", file=sys.stderr)
    return {"wall_s": wall, "first_token_s": first if first_token else None, "ok": ok}


def main() -> int:
    ap = arg_parser(__doc__, "one run of each command, 2 tokens")
    ap.add_argument("--runs", type=int, default=3, help="runs of each command per tree (default: 3)")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens generate makes (default: 8)")
    ap.add_argument("--compare", type=Path, default=None, metavar="DIR",
                    help="another checkout's python/ folder, timed in the same interleaved runs")
    ap.add_argument("--label", default="this tree", help="name of this tree in the table (default: this tree)")
    ap.add_argument("--compare-label", default="compare", help="name of the --compare tree (default: compare)")
    args = ap.parse_args()
    runs, max_tokens = (1, 2) if args.quick else (args.runs, args.max_tokens)
    trees = [(args.label, ROOT / "python")] + ([(args.compare_label, args.compare.resolve())] if args.compare else [])
    samples: dict[tuple[str, str], list[dict]] = {}
    for _ in range(runs):
        for case, argv, first_token in CASES:
            for tree, path in trees:  # interleaved: each pair of runs sees the same machine load
                samples.setdefault((tree, case), []).append(run_once(path, argv, first_token, max_tokens))
    rows = []
    for (tree, case), runs_of in samples.items():
        key = "first_token_s" if runs_of[0]["first_token_s"] is not None else "wall_s"
        values = [r[key] for r in runs_of if r[key] is not None]
        rows.append({"tree": tree, "command": case, "measure": key.removesuffix("_s").replace("_", " "),
                     "median_s": statistics.median(values) if values else None,
                     "runs_s": ", ".join(f"{v:.2f}" for v in values), "goal_s": GOALS[case],
                     "all_ok": all(r["ok"] for r in runs_of)})
    columns = ["tree", "command", "measure", "median_s", "runs_s", "goal_s", "all_ok"]
    table = markdown_table(rows, columns)
    print(table)
    name = "cli_startup_quick" if args.quick else "cli_startup"
    trees_md = "\n".join(f"- {tree}: `{path}`" for tree, path in trees)
    save(name, {"runs": runs, "max_tokens": max_tokens, "prompt": PROMPT, "trees": {t: str(p) for t, p in trees},
                "rows": rows},
         f"`pagedserve` start-up, wall seconds ({runs} interleaved runs each; cached default model, CPU)\n\n"
         f"{trees_md}\n\n{table}", args.out)
    return 0 if all(r["all_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
