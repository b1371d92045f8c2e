"""Shared helpers for bench scripts: the machine and the versions of every engine a run used,
JSON + markdown output, raw dumps kept out of git.

Every results file records, beside its figures:
  machine   date, platform, Python, CPU model, the ISA pagedserve's CPU ops run with and the
            CPU's vector/matrix flags, core count, load average, torch threads, GPU and CUDA;
  versions  pagedserve (version and git commit, "-dirty" when the tree had uncommitted
            changes), torch, and transformers whenever the run imported it (it compared
            against it, or used its tokenizer).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[1]
ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
RAW = "raw"  # sweeps, probe dumps and logs: <out>/raw/, ignored by git

# The CPU flags that decide which kernels run (x86 vector/matrix extensions, Arm SIMD).
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2", "bf16")


def arg_parser(doc: str, quick: str) -> argparse.ArgumentParser:
    """A bench script's parser: its docstring as the description, --quick (`quick` says what it
    shrinks) and --out."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")
    return ap


def add_engine_options(ap: argparse.ArgumentParser) -> None:
    """--option key=value (repeatable): engine options (EngineConfig fields) for the variant measured."""
    ap.add_argument("--option", action="append", default=[], help="engine option key=value (repeatable)")


def engine_options(pairs: list[str]) -> dict:
    """The --option pairs as LLM keyword arguments: true/false as booleans, digits as ints."""
    options = {}
    for pair in pairs:
        key, value = pair.split("=", 1)
        options[key] = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)
    return options


def require_cuda(script: str, build: bool = True) -> None:
    """Ends a GPU-only script with one line where torch sees no CUDA device (or, with build, where
    pagedserve lacks its CUDA build)."""
    import torch

    from pagedserve import _core
    if not torch.cuda.is_available() or (build and not getattr(_core, "has_cuda", False)):
        needs = "a CUDA GPU and pagedserve built with USE_CUDA=ON" if build else "a CUDA GPU"
        raise SystemExit(f"{Path(script).name}: needs {needs} (scripts/gpu_check.sh runs it on one)")


def machine_info() -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "processor": _cpu_model(),
        "cpu_flags": " ".join(f for f in ISA_FLAGS if f in _cpu_flags()),
    }
    try:
        from pagedserve import ops
        info["pagedserve_cpu_isa"] = ops.cpu_isa()
    except (ImportError, AttributeError):
        pass
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
            info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return info


def versions() -> dict:
    """The versions of every engine this run used: pagedserve (and its commit), torch, transformers."""
    out = {"pagedserve": _pagedserve_version(), "pagedserve_commit": git_commit()}
    for name in ("torch", "transformers"):
        module = sys.modules.get(name)
        if module is not None:
            out[name] = getattr(module, "__version__", "unknown")
    return out


def git_commit() -> str:
    """HEAD of the checkout the bench runs from, "-dirty" when tracked files differ from it."""
    if os.environ.get("PAGEDSERVE_COMMIT"):  # a copy of the tree without .git (e.g. a GPU machine) says it
        return os.environ["PAGEDSERVE_COMMIT"]
    try:
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "not recorded (no git checkout)"
    return sha + ("-dirty" if dirty else "")


def _pagedserve_version() -> str:
    try:
        import pagedserve
        return pagedserve.__version__
    except ImportError:
        return "not installed"


def _cpu_model() -> str:
    """The first CPU's model name, with its x86 family and model numbers: VMs often show only "AMD EPYC" or
    "Intel(R) Xeon(R) Processor", and the numbers tell a Zen 4 (family 25) from a Zen 5 (26)."""
    try:
        fields: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if not key.strip():
                break  # the first CPU's block ends
            fields.setdefault(key.strip(), value.strip())
        if "model name" in fields:
            numbers = f" (family {fields['cpu family']}, model {fields['model']})" \
                if "cpu family" in fields and "model" in fields else ""
            return fields["model name"] + numbers
    except OSError:
        pass
    return platform.processor()


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def header_line(machine: dict, engines: dict) -> str:
    """One line naming the machine and the versions, as each results markdown starts."""
    cpu, isa = machine.get("processor"), machine.get("pagedserve_cpu_isa")
    parts = [machine.get("date", "date not recorded"), machine.get("gpu") or machine.get("device"),
             cpu and cpu + (f" (CPU ops: {isa})" if isa else ""),
             f"{machine['cpu_count']} CPUs" if machine.get("cpu_count") else None,
             f"Python {machine['python']}" if machine.get("python") else None]
    if "load_average_1m" in machine:
        parts.append(f"load average {machine['load_average_1m']}")
    if "pagedserve" in engines:
        parts.append(f"pagedserve {engines['pagedserve']} ({engines.get('pagedserve_commit', 'commit not recorded')})")
    parts += [f"{name} {engines[name]}" for name in ("torch", "transformers") if name in engines]
    return " · ".join(p for p in parts if p)


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
    """Writes <out_dir>/<name>.json (machine, versions, payload) and <name>.md (a header line naming
    them, then `markdown`); out_dir defaults to bench/results. Returns the JSON's path."""
    out_dir = Path(out_dir) if out_dir else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine_info(), "versions": versions(), **payload}
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out_dir / f"{name}.md").write_text(f"_{header_line(payload['machine'], payload['versions'])}_\n\n"
                                        + markdown + "\n")
    return out_dir / f"{name}.json"


def save_raw(name: str, payload: dict, out_dir: Path | None = None) -> Path:
    """A full sweep or probe dump: <out_dir>/raw/<name>.json, which git ignores."""
    raw_dir = (Path(out_dir) if out_dir else RESULTS_DIR) / RAW
    raw_dir.mkdir(parents=True, exist_ok=True)
    path = raw_dir / f"{name}.json"
    path.write_text(json.dumps({"machine": machine_info(), "versions": versions(), **payload}, indent=2) + "\n")
    return path
