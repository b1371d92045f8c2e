"""Renders bench/results/RESULTS.md from the JSON results under bench/results/ and
its per-machine subfolders (e.g. h200/), raw/ folders left out: the headline
throughput table and a combined plot per device, then one section per benchmark,
GPU figures apart from CPU ones and from the exact (model-free) figures, each
with the machine, versions (pagedserve and its commit, torch, transformers) and
date its JSON recorded, the markdown its script wrote, and its PNG if there is one.
RESULTS.md is generated: edit the scripts or rerun them, never the file.

    python bench/make_results.py                    # bench/results/RESULTS.md
    python bench/make_results.py --out /tmp/res     # results read from and written to another folder
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common.plots import ENGINES, draw_throughput, pyplot  # noqa: E402
from common.report import RAW, RESULTS_DIR, header_line, markdown_table  # noqa: E402

# (section title, file-name patterns), in the order RESULTS.md shows them.
SECTIONS = [
    ("Throughput vs concurrency", ["throughput_*", "cpu_throughput_*"]),
    ("CPU serving: each CPU mode against transformers", ["cpu_serving*"]),
    ("KV memory: paged vs contiguous", ["memory*"]),
    ("Standard workload: long sequences", ["long_workload*"]),
    ("Demos", ["demo_waste*", "demo_latency*", "demo_block_table*", "demo_prefix_sharing*",
               "demo_parallel_sampling*", "demo_preemption*", "demo_*"]),
    ("Serving: OpenAI API under Poisson arrivals", ["serve*"]),
    ("Decode step: host vs device time", ["step_timing*", "step_overhead*"]),
    ("Kernels and CPU ops", ["kernel_bench*", "cpu_ops*", "cpu_dtype*", "sampler_*"]),
    ("Scheduler step cost", ["scheduler*"]),
    ("Tensor parallelism", ["tp_cpu*", "tp_comm_model*"]),
    ("Numerics: bf16 against transformers and torch SDPA", ["bf16_agreement*", "sdpa_numerics*", "softmax_numerics*",
                                                           "norm_numerics*"]),
    ("GPU tests and compute-sanitizer", ["gpu_tests*"]),
]
EXACT = ["memory*", "demo_block_table*", "tp_comm_model*"]  # no model runs: the same figures on any machine
GROUPS = [("gpu", "GPU figures"), ("cpu", "CPU figures"),
          ("exact", "Exact figures (scheduler and arithmetic only, no model: the same on any machine)")]
BODY_LEVEL = 4  # a result's own headings sit under "## group" and "### section"


class Result:
    def __init__(self, path: Path, root: Path):
        self.path, self.root = path, root
        self.data = json.loads(path.read_text())
        self.stem = path.stem

    @property
    def rel(self) -> str:
        return self.path.relative_to(self.root).as_posix()

    def sibling(self, suffix: str) -> Path:
        return self.path.with_suffix(suffix)

    def matches(self, patterns: list[str]) -> bool:
        return any(fnmatch.fnmatch(self.stem, p) for p in patterns)

    def order_in(self, patterns: list[str]) -> tuple[int, str]:
        """Sorts a section's results by the first pattern they match (the section's intended order)."""
        return next(i for i, p in enumerate(patterns) if fnmatch.fnmatch(self.stem, p)), self.rel

    def device(self) -> str:
        d = self.data
        declared = d.get("device") or (d.get("row") or {}).get("device") or (d.get("config") or {}).get("device")
        if declared is None and isinstance(d.get("rows"), list) and d["rows"] and isinstance(d["rows"][0], dict):
            declared = d["rows"][0].get("device")
        if declared:
            return "gpu" if str(declared).startswith("cuda") else "cpu"
        return "gpu" if (d.get("machine") or {}).get("gpu") else "cpu"

    def group(self) -> str:
        return "exact" if self.matches(EXACT) else self.device()

    def machine_line(self) -> str:
        return header_line(self.data.get("machine") or {}, self.data.get("versions") or {})


def load_results(root: Path) -> list[Result]:
    paths = sorted(root.glob("*.json")) + sorted(p for p in root.glob("*/*.json") if p.parent.name != RAW)
    return [Result(p, root) for p in paths]


def link(target: Path, out_dir: Path) -> str:
    return Path(os.path.relpath(target, out_dir)).as_posix()


def body_of(result: Result) -> str:
    """The markdown its script wrote, less the script's own date line, its top heading at BODY_LEVEL."""
    md = result.sibling(".md")
    if not md.exists():
        rows = result.data.get("rows")
        if isinstance(rows, list) and rows and isinstance(rows[0], dict):
            return markdown_table(rows, list(rows[0]))
        return "_(no markdown was saved beside this JSON)_"
    lines = md.read_text().rstrip().splitlines()
    if lines and lines[0].startswith("_") and lines[0].endswith("_"):
        lines = lines[1:]
    levels = [len(line) - len(line.lstrip("#")) for line in lines if line.startswith("#")]
    shift = "#" * (BODY_LEVEL - min(levels)) if levels else ""
    return "\n".join((shift + line) if line.startswith("#") else line for line in lines).strip()


def render_result(result: Result, out_dir: Path) -> str:
    parts = [f"_{result.machine_line()}_ — from [`{result.rel}`]({link(result.path, out_dir)})", "", body_of(result)]
    png = result.sibling(".png")
    if png.exists():
        parts += ["", f"![{result.stem}]({link(png, out_dir)})"]
    return "\n".join(parts)


def is_headline(result: Result) -> bool:
    d = result.data
    return (result.matches(SECTIONS[0][1]) and not result.stem.endswith("_quick") and "rows" in d
            and d.get("min_output_len") is None and d.get("requests_per_slot", 1) == 1)


def headline_table(results: list[Result]) -> str:
    rows = []
    for r in results:
        by = {(row["engine"], row["concurrency"]): row for row in r.data["rows"]}
        for c in sorted({row["concurrency"] for row in r.data["rows"]}):
            ours, static, seq = (by.get((e, c)) for e in ENGINES)
            if ours is None:
                continue
            rows.append({"model": f"{r.data.get('model')} ({r.data.get('dtype')}, {r.data.get('output_len')} out)",
                         "concurrency": c,
                         "pagedserve tok/s": ours["output_tok_s"],
                         "transformers static batch tok/s": static and static["output_tok_s"],
                         "transformers one at a time tok/s": seq and seq["output_tok_s"],
                         "x vs static": static and ours["output_tok_s"] / static["output_tok_s"],
                         "x vs one at a time": seq and ours["output_tok_s"] / seq["output_tok_s"],
                         "pagedserve ms/token": ours["ms_per_output_token"],
                         "pagedserve peak GPU GiB": _peak(ours),
                         "static batch peak GPU GiB": static and static.get("peak_gpu_gib")})
    return markdown_table(rows, list(rows[0])) if rows else ""


def _peak(row: dict) -> str | None:
    """Peak GPU memory, with the KV pool inside it (sized once, up front) and the KV actually held."""
    if row.get("peak_gpu_gib") is None:
        return None
    if row.get("kv_pool_gib") is None:
        return f"{row['peak_gpu_gib']:.2f}"
    return f"{row['peak_gpu_gib']:.2f} (KV pool {row['kv_pool_gib']:.1f}, KV held {row['kv_peak_used_gib']:.2f})"


def combined_plot(results: list[Result], path: Path, title: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, r in zip(axes[0], results):
        draw_throughput(ax, r.data["rows"],
                        f"{r.data.get('model')} ({r.data.get('dtype')}), {r.data.get('output_len')} output tokens")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def headline(results: list[Result], out_dir: Path, plots: bool) -> list[str]:
    intro = ("A fixed number of output tokens per request (`ignore_eos`; the issue's figure is 150), random "
             "24-token prompts, all requests submitted at once; transformers one request at a time (measured on a "
             "sample: its rate does not depend on concurrency) and in static padded batches, in the same script. "
             "pagedserve's peak GPU memory holds its whole KV pool, sized up front; the KV it actually held is "
             "beside it. `bench/perf/throughput.py`.")
    lines = ["## Headline: output throughput vs concurrency", "", intro, ""]
    by_dir = defaultdict(list)
    for r in results:
        if is_headline(r):
            by_dir[(r.group(), r.path.parent)].append(r)
    for (group, folder), rs in sorted(by_dir.items(), key=lambda kv: (kv[0][0] != "gpu", str(kv[0][1]))):
        rs.sort(key=lambda r: str(r.data.get("model")))
        lines += [f"### {'GPU' if group == 'gpu' else 'CPU'}: {rs[0].machine_line()}", "", headline_table(rs), ""]
        png = folder / f"throughput_combined_{group}.png"
        if plots:
            combined_plot(rs, png, f"Output throughput vs concurrency ({'GPU' if group == 'gpu' else 'CPU'})")
        if png.exists():
            lines += [f"![throughput vs concurrency]({link(png, out_dir)})", ""]
    return lines


def render(results: list[Result], out_dir: Path, plots: bool = True) -> str:
    note = ("_Generated by `python bench/make_results.py` from the JSON files under `bench/results/`; do not edit "
            "by hand. Every figure comes from a script in `bench/perf/`, `bench/demos/` or `bench/numerics/` "
            "(`--help` on each); baselines run in the same script, so ratios hold on noisy machines. Raw sweeps "
            "and logs stay out of git (`raw/`)._")
    lines = ["# pagedserve benchmark results", "", note, ""]
    lines += headline(results, out_dir, plots)
    placed: set[str] = set()
    for group, group_title in GROUPS:
        members = [r for r in results if r.group() == group]
        if not members:
            continue
        lines += [f"## {group_title}", ""]
        for title, patterns in SECTIONS + [("Other", ["*"])]:
            chosen = sorted((r for r in members if r.matches(patterns) and r.rel not in placed),
                            key=lambda r: r.order_in(patterns))
            if not chosen:
                continue
            lines += [f"### {title}", ""]
            for r in chosen:
                placed.add(r.rel)
                lines += [render_result(r, out_dir), ""]
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR, help="the results folder, read and written")
    ap.add_argument("--no-plot", action="store_true", help="skip the combined throughput plots")
    ap.add_argument("--quick", action="store_true", help="accepted like every bench script's; changes nothing")
    ap.add_argument("--print-headline", action="store_true",
                    help="also print the headline section, links relative to the repository root (for the README)")
    args = ap.parse_args()
    out_dir = args.out.resolve()
    results = load_results(out_dir)
    if not results:
        raise SystemExit(f"no JSON results under {out_dir}")
    text = render(results, out_dir, plots=not args.no_plot)
    (out_dir / "RESULTS.md").write_text(text)
    print(f"wrote {out_dir / 'RESULTS.md'} from {len(results)} result files")
    if args.print_headline:
        print("\n".join(headline(results, out_dir.parent.parent, plots=False)))


if __name__ == "__main__":
    main()
