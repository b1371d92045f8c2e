"""Matplotlib helpers shared by the bench scripts and make_results.py (headless: the Agg backend)."""

from __future__ import annotations

ENGINES = ("pagedserve", "transformers-static-batch", "transformers-sequential")


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def draw_throughput(ax, rows: list[dict], title: str) -> None:
    """Output tok/s vs concurrency, one line per engine, log-log (rows as throughput.py saves them)."""
    for engine in ENGINES:
        pts = sorted((r["concurrency"], r["output_tok_s"]) for r in rows if r["engine"] == engine)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=engine)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
