"""Greedy agreement with transformers float32 on the CPU: what decides cpu_precision "auto".

For the 32 prompts of pagedserve.testing.agreement, 16 greedy tokens each, transformers float32
(one prompt at a time) is the reference. Side by side:
  - transformers bf16 against it: the bar a bf16 mode has to clear;
  - pagedserve cpu_precision float32 (the exact path; a sanity check);
  - pagedserve cpu_precision bfloat16 (bf16 activations into the matrix kernels);
  - pagedserve quantization int8 (per-channel int8 weights, dynamically int8 activations), and its
    first-step logits against the bfloat16 mode's.
Agreement is counted per prompt (all 16 tokens equal) and per token (tokens before the first difference).
engine_config.resolve_cpu_precision makes auto = bfloat16 only where ours >= transformers' own bf16.

    python bench/numerics/cpu_precision_agreement.py [--quick] [--out DIR]   (--quick: the first 8 prompts)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.report import arg_parser, markdown_table, save  # noqa: E402

from pagedserve.testing.agreement import N_TOKENS, agreement_prompts, first_step_logits, hf_greedy  # noqa: E402


def progress(message):
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def agreement(name, ours, want):
    prefix = [next((i for i, (a, b) in enumerate(zip(o, w)) if a != b), len(w)) for o, w in zip(ours, want)]
    return {"variant": name, "prompts_agree": sum(p == len(w) for p, w in zip(prefix, want)),
            "prompts": len(want), "tokens_agree": sum(prefix), "tokens": sum(len(w) for w in want)}


def ours_greedy(llm, prompts):
    from pagedserve import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, min_tokens=N_TOKENS)
    return [r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


def main():
    ap = arg_parser(__doc__, "the first 8 prompts")
    ap.add_argument("--model", default=None, help="model directory (default: the default model)")
    ap.add_argument("--no-int8", action="store_true", help="skip the int8 variant")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedserve import LLM, ops
    from pagedserve.models.default_model import model_path
    path = model_path(args.model)
    prompts = agreement_prompts(AutoTokenizer.from_pretrained(path))[: 8 if args.quick else None]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    progress("transformers float32")
    want, _ = hf_greedy(hf, prompts)
    progress("transformers bfloat16")
    rows = []
    hf_bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    rows.append(agreement("transformers bfloat16", hf_greedy(hf_bf16, prompts)[0], want))
    del hf_bf16
    variants = [("pagedserve cpu_precision float32", dict(cpu_precision="float32")),
                ("pagedserve cpu_precision bfloat16", dict(cpu_precision="bfloat16"))]
    if not args.no_int8:
        variants.append(("pagedserve quantization int8", dict(quantization="int8")))
    logits = {}
    for name, options in variants:
        progress(name)
        llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=1024, **options)
        rows.append(agreement(name, ours_greedy(llm, prompts), want))
        with torch.inference_mode():
            logits[name] = torch.stack([first_step_logits(llm, p) for p in prompts])
        llm.shutdown()
    with torch.inference_mode():
        reference = torch.stack([hf(torch.tensor([p])).logits[0, -1].float() for p in prompts])
    for row in rows:
        if row["variant"] in logits:
            row["first_step_max_abs_logit_diff_vs_hf_float32"] = round(
                float((logits[row["variant"]] - reference).abs().max()), 4)
    hf_bar = rows[0]["tokens_agree"]
    ours_bf16 = next(r for r in rows if r["variant"].endswith("bfloat16") and r["variant"].startswith("pagedserve"))
    verdict = "bfloat16" if ours_bf16["tokens_agree"] >= hf_bar else "float32"
    columns = ["variant", "prompts_agree", "prompts", "tokens_agree", "tokens",
               "first_step_max_abs_logit_diff_vs_hf_float32"]
    text = (f"# CPU greedy agreement with transformers float32, {N_TOKENS} tokens, {len(prompts)} prompts\n\n"
            f"{markdown_table(rows, columns)}\n\n"
            f"CPU kernels: {ops.cpu_kernels()}. cpu_precision auto on this evidence: **{verdict}** (pagedserve "
            f"bfloat16 keeps {ours_bf16['tokens_agree']} tokens before the first difference, transformers "
            f"bfloat16 {hf_bar}).\n")
    print(text)
    save("cpu_precision" + ("_quick" if args.quick else ""),
         {"rows": rows, "auto": verdict, "cpu_kernels": ops.cpu_kernels()}, text, args.out)


if __name__ == "__main__":
    main()
