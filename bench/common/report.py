"""Shared helpers for bench scripts: machine info, JSON + markdown output."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine_info() -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "processor": _cpu_model(),
    }
    for var in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY"):
        if var in os.environ:
            info[var] = os.environ[var]
    if hasattr(os, "getloadavg"):  # other work on a shared machine skews CPU timings: keep it on record
        info["load_average_1m"] = round(os.getloadavg()[0], 2)
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.2f}" if abs(v) >= 0.01 else f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def save(name: str, payload: dict, markdown: str, out_dir: Path | None = None) -> Path:
    out_dir = Path(out_dir) if out_dir else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine_info(), **payload}
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    m = payload["machine"]
    header = f"_{m['date']} · {m.get('gpu') or m['processor']} · {m['cpu_count']} CPUs · torch {m.get('torch', '-')}_\n\n"
    (out_dir / f"{name}.md").write_text(header + markdown + "\n")
    return out_dir / f"{name}.json"
