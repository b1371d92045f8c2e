"""Where the CPU engine's resident memory goes, stage by stage, in one fresh process.

Loads the default model (SmolLM2-135M-Instruct) on the CPU in one mode and records, after each stage of
LLM(...) and of serving, the process's VmRSS (resident now), its VmHWM (the high-water mark so far) and
the largest VmRSS a 2 ms sampler saw since the previous stage (the stage's own peak):

    imports        torch, pagedserve
    model config   ModelConfig + resolved EngineConfig (the engine's first steps)
    tokenizer      the tokenizer loaded
    weights        build_model: parameters allocated and filled from the checkpoint, each decoder linear
                   put into its CPU kernel (bf16 tiles, int8 channels) as it is filled (StreamedPacking)
    packing        StreamedPacking.finish: the LM head (and what "auto" decides at the end)
    engine ready   KV cache, workspace, worst-case buffers, heap trimmed (LLM(...) returned)
    batch N        N requests (24-token prompts, --tokens output tokens) served to completion

Stage boundaries come from wrapping the worker's build_model / StreamedPacking.finish and the engine's
load_tokenizer in this process only (measurement, no behaviour change).

    PYTHONPATH=python python bench/perf/cpu_rss_breakdown.py [--mode bfloat16|float32|int8] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
from pathlib import Path


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
        self.rows.append({"stage": stage, "rss_mib": round(rss, 1), "stage_peak_mib": round(max(self._peak, rss), 1),
                          "hwm_mib": round(status_mib("VmHWM"), 1)})
        self._peak = rss

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


MODES = {"bfloat16": {}, "float32": {"cpu_precision": "float32"}, "int8": {"quantization": "int8"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="bfloat16", help="bfloat16 (the default CPU mode here), float32, int8, "
                                                           "or a .gguf file")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=8, help="output tokens per request")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
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
    options = dict(MODES.get(args.mode, {}))
    model = args.mode if args.mode.endswith(".gguf") else str(default_model_dir())
    llm = LLM(model, device="cpu", max_num_seqs=args.batch, **options)
    stages.mark("engine ready")
    import numpy as np
    prompts = np.random.default_rng(0).integers(100, 30000, size=(args.batch, 24)).tolist()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True), use_tqdm=False)
    stages.mark(f"batch {args.batch} ({time.perf_counter() - start:.1f} s)")
    stages.stop()
    worker = llm.llm_engine.worker
    plan = worker.kv_plan
    print(f"mode {args.mode}: KV pool {plan.num_blocks} blocks x {plan.bytes_per_block / 2**10:.0f} KiB = "
          f"{plan.num_bytes / 2**20:.0f} MiB ({plan.dtype}), max_model_len {plan.max_model_len}")
    if args.json:
        print(json.dumps(stages.rows))
    print(f"{'stage':<22} {'VmRSS':>8} {'stage peak':>11} {'VmHWM':>8}  (MiB)")
    for row in stages.rows:
        print(f"{row['stage']:<22} {row['rss_mib']:>8.1f} {row['stage_peak_mib']:>11.1f} {row['hwm_mib']:>8.1f}")


if __name__ == "__main__":
    main()
