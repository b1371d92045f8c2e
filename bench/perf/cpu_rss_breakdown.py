"""Where the CPU engine's resident memory goes, stage by stage, one fresh process per mode.

Each mode loads the default model (SmolLM2-135M-Instruct) on the CPU and records, after each stage of
LLM(...) and of serving, the process's VmRSS (resident now), its VmHWM (the high-water mark so far) and
the largest VmRSS a 2 ms sampler saw since the previous stage (the stage's own peak):

    imports        torch, pagedserve
    tokenizer      the tokenizer loaded
    weights        build_model: parameters allocated and filled from the checkpoint, each decoder linear
                   put into its CPU kernel (bf16 tiles, int8 channels) as it is filled (StreamedPacking)
    packing        StreamedPacking.finish: the LM head (and what "auto" decides at the end)
    engine ready   KV cache, workspace, heap trimmed (LLM(...) returned)
    batch N        N requests (24-token prompts, --tokens output tokens) served to completion

Stage boundaries come from wrapping the worker's build_model / StreamedPacking.finish (pack_cpu_weights
in a tree from before it) and the engine's load_tokenizer, in the child process only (measurement, no
behaviour change). Modes: bfloat16 (the default CPU mode where the CPU has AVX512_BF16 or AMX), float32
(cpu_precision float32), int8, and a .gguf file with --gguf. To compare trees, run it with PYTHONPATH
pointing at each tree's python/.

    PYTHONPATH=python python bench/perf/cpu_rss_breakdown.py [--batch 64] [--tokens 8] [--gguf FILE]
    PYTHONPATH=python python bench/perf/cpu_rss_breakdown.py --quick     # default mode, batch 4, 2 tokens
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.report import arg_parser, markdown_table, save  # noqa: E402

MODES = {"bfloat16": {}, "float32": {"cpu_precision": "float32"}, "int8": {"quantization": "int8"}}


def status_mib(field: str) -> float:
    return int(re.search(field + r":\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


class Stages:
    """Records (stage, VmRSS, peak VmRSS since the last stage, VmHWM) at each mark()."""

    def __init__(self):
        self.rows: list[dict] = []
        self._peak = status_mib("VmRSS")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._stop.wait(0.002):
            self._peak = max(self._peak, status_mib("VmRSS"))

    def mark(self, stage: str) -> None:
        rss = status_mib("VmRSS")
        self.rows.append({"stage": stage, "rss_mib": rss, "stage_peak_mib": max(self._peak, rss),
                          "hwm_mib": status_mib("VmHWM")})
        self._peak = rss

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def child(mode: str, batch: int, tokens: int) -> dict:
    stages = Stages()
    import torch  # noqa: F401

    import pagedserve.engine.engine as engine_module
    import pagedserve.worker.worker as worker_module
    from pagedserve import LLM, SamplingParams
    from pagedserve.models.default_model import default_model_dir
    stages.mark("imports")

    def after(stage, fn):
        def wrapped(*a, **kw):
            out = fn(*a, **kw)
            stages.mark(stage)
            return out
        return wrapped

    engine_module.load_tokenizer = after("tokenizer", engine_module.load_tokenizer)
    worker_module.build_model = after("weights", worker_module.build_model)
    if hasattr(worker_module, "StreamedPacking"):
        packing = worker_module.StreamedPacking
        packing.finish = after("packing", packing.finish)
    else:  # a tree from before StreamedPacking (before/after comparisons): the model is packed whole
        worker_module.pack_cpu_weights = after("packing", worker_module.pack_cpu_weights)
    gguf = mode.endswith(".gguf")
    llm = LLM(mode if gguf else str(default_model_dir()), device="cpu", max_num_seqs=batch,
              **({} if gguf else MODES[mode]))
    stages.mark("engine ready")
    import numpy as np
    prompts = np.random.default_rng(0).integers(100, 30000, size=(batch, 24)).tolist()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - start
    stages.mark(f"batch {batch} x {tokens} tokens")
    stages.stop()
    plan = llm.llm_engine.worker.kv_plan
    return {"rows": stages.rows, "batch_seconds": seconds, "kv_pool_mib": plan.num_bytes / 2**20,
            "kv_dtype": str(plan.dtype).removeprefix("torch."), "cpu_precision": llm.llm_engine.config.cpu_precision}


def run_child(mode: str, batch: int, tokens: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps([mode, batch, tokens])],
                          capture_output=True, text=True, timeout=900, check=False)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"mode {mode} failed: {(proc.stderr or proc.stdout)[-2000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = arg_parser(__doc__, "the default mode only, batch 4, 2 output tokens")
    parser.add_argument("--child", default=None, help="internal: one mode in this process (JSON [mode, batch, "
                                                      "tokens])")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=8, help="output tokens per request")
    parser.add_argument("--gguf", default=None, help="also a .gguf checkpoint of the model")
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(*json.loads(args.child))), flush=True)
        return
    batch, tokens = (4, 2) if args.quick else (args.batch, args.tokens)
    modes = ["bfloat16"] if args.quick else list(MODES) + ([args.gguf] if args.gguf else [])
    results, md = {}, []
    for mode in modes:
        name = Path(mode).name
        print(f"{name}: batch {batch} x {tokens} tokens", flush=True)
        results[name] = run_child(mode, batch, tokens)
        res = results[name]
        rows = [{k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()} for row in res["rows"]]
        md += [f"### {name} (cpu_precision {res['cpu_precision']}, KV {res['kv_dtype']}, pool "
               f"{res['kv_pool_mib']:.0f} MiB allocated; batch took {res['batch_seconds']:.1f} s)", "",
               markdown_table(rows, ["stage", "rss_mib", "stage_peak_mib", "hwm_mib"]), ""]
    title = f"CPU engine resident memory by stage: SmolLM2-135M-Instruct, batch {batch}, 24-token prompts, " \
            f"{tokens} output tokens (MiB)"
    text = "\n".join([f"## {title}", ""] + md)
    print(text)
    path = save("cpu_rss_breakdown" + ("_quick" if args.quick else ""),
                {"batch": batch, "prompt_len": 24, "output_len": tokens, "modes": results}, text, args.out)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
