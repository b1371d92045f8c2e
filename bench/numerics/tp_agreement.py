"""Tensor parallelism on GPUs, TP = 2 (NCCL) against TP = 1 on the same GPU type, with transformers'
own bf16-vs-float32 agreement as the bar.

Per model, the 32 prompts of the GPU agreement test (pagedserve.testing.agreement), 16 greedy tokens:
  - transformers bf16 against transformers float32 (the same bf16-valued weights): how many prompts
    keep all 16 tokens, and the mean share of tokens before the first difference. This is the noise
    floor that bf16 rounding alone gives;
  - pagedserve bf16, TP = 2 against TP = 1 (CUDA graphs on): the same two numbers. The target is
    agreement at least as high as transformers' own;
  - pagedserve float32, TP = 2 against TP = 1: greedy tokens identical and the largest difference of
    the prompt and sampled logprobs (the target: within 1e-4).
Models: random weights (transformers' initialisation, seeded, saved as a bf16 checkpoint) of the
Llama-3-8B shape (all 32 layers) and of the Qwen3-30B-A3B shape (128 experts, top 8; its first
--moe-layers layers of 48, so that transformers' float32 copy fits one card), and the default model's
real weights.

    python bench/numerics/tp_agreement.py [--models llama-3-8b qwen3-30b-a3b default] [--out DIR]
    python bench/numerics/tp_agreement.py --quick     # the default model, 8 prompts
(needs two CUDA GPUs and the CUDA build)
"""

from __future__ import annotations

import gc
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.model_shapes import SHAPES  # noqa: E402
from common.report import arg_parser, markdown_table, require_cuda, save  # noqa: E402
from perf.throughput import prompts_for  # noqa: E402

from pagedserve.testing.agreement import N_TOKENS, agreement_prompts, hf_greedy  # noqa: E402

LOGPROB_TOL = 1e-4
DEVICE = "cuda"  # the ranks take cuda:0 and cuda:1; transformers runs on cuda:0


def agreement(ours: list[list[int]], want: list[list[int]]) -> dict:
    """Prompts whose tokens all agree, and the mean share of tokens before the first difference."""
    prefix = []
    for a, b in zip(ours, want):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(same / N_TOKENS)
    return {"prompts_same": sum(p == 1.0 for p in prefix), "token_share": sum(prefix) / len(prefix)}


def checkpoint(name: str, moe_layers: int, root: Path):
    """(checkpoint dir, transformers model in bf16 on cuda:0) for a named shape or the default model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if name == "default":
        from pagedserve.models.default_model import default_model_dir
        path = default_model_dir()
        return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEVICE)
    fields = dict(SHAPES[name])
    if fields["model_type"] == "qwen3_moe":
        fields["num_hidden_layers"] = moe_layers
    config = AutoConfig.for_model(**fields)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    path = root / name
    model.save_pretrained(path)
    return path, model.eval()


def engine_run(path: Path, dtype: str, tp: int, prompts: list[list[int]]) -> list:
    from pagedserve import LLM, SamplingParams

    llm = LLM(str(path), dtype=dtype, device=DEVICE, tensor_parallel_size=tp, max_model_len=256,
              max_num_seqs=len(prompts), num_kv_blocks=1024)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, min_tokens=N_TOKENS, logprobs=0,
                                prompt_logprobs=0 if dtype == "float32" else None)
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def logprob_difference(a, b) -> float:
    """Largest |logprob difference| over the prompt and the sampled tokens (while the tokens agree)."""
    worst = 0.0
    for x, y in zip(a, b):
        if x.prompt_logprobs:
            for i in range(1, len(x.prompt_token_ids)):
                token = x.prompt_token_ids[i]
                worst = max(worst, abs(x.prompt_logprobs[i][token].logprob - y.prompt_logprobs[i][token].logprob))
        for tx, ty, ex, ey in zip(x.outputs[0].token_ids, y.outputs[0].token_ids, x.outputs[0].logprobs,
                                  y.outputs[0].logprobs):
            if tx != ty:
                break
            worst = max(worst, abs(ex[tx].logprob - ey[ty].logprob))
    return worst


def measure(name: str, moe_layers: int, prompts: list[list[int]], root: Path) -> dict:
    path, hf = checkpoint(name, moe_layers, root)
    hf_bf16, _ = hf_greedy(hf, prompts)
    hf_fp32, _ = hf_greedy(hf.float(), prompts)
    layers = hf.config.num_hidden_layers
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    tokens = lambda outs: [o.outputs[0].token_ids for o in outs]  # noqa: E731
    bf16 = {tp: engine_run(path, "bfloat16", tp, prompts) for tp in (1, 2)}
    fp32 = {tp: engine_run(path, "float32", tp, prompts) for tp in (1, 2)}
    floor = agreement(hf_bf16, hf_fp32)
    tp_bf16 = agreement(tokens(bf16[2]), tokens(bf16[1]))
    tp_fp32 = agreement(tokens(fp32[2]), tokens(fp32[1]))
    worst = logprob_difference(fp32[2], fp32[1])
    return {"model": name, "layers": layers, "prompts": len(prompts),
            "hf_bf16_vs_fp32_same": floor["prompts_same"], "hf_bf16_vs_fp32_tokens": floor["token_share"],
            "tp2_vs_tp1_bf16_same": tp_bf16["prompts_same"], "tp2_vs_tp1_bf16_tokens": tp_bf16["token_share"],
            "tp1_bf16_vs_hf_fp32_same": agreement(tokens(bf16[1]), hf_fp32)["prompts_same"],
            "tp2_vs_tp1_fp32_same": tp_fp32["prompts_same"], "fp32_max_logprob_diff": worst,
            "bf16_ok": tp_bf16["token_share"] >= floor["token_share"],
            "fp32_ok": tp_fp32["prompts_same"] == len(prompts) and worst <= LOGPROB_TOL}


def main() -> None:
    ap = arg_parser(__doc__, "the default model, 8 prompts: checks the script works")
    ap.add_argument("--models", nargs="+", default=["llama-3-8b", "qwen3-30b-a3b", "default"])
    ap.add_argument("--moe-layers", type=int, default=8, help="layers of the Qwen3-30B-A3B shape kept")
    args = ap.parse_args()
    require_cuda(__file__)
    if torch.cuda.device_count() < 2:
        raise SystemExit("tp_agreement.py needs two CUDA GPUs")
    models = ["default"] if args.quick else args.models
    if "default" in models:
        from transformers import AutoTokenizer
        from pagedserve.models.default_model import default_model_dir

        prompts = agreement_prompts(AutoTokenizer.from_pretrained(default_model_dir()))
    else:  # random weights need no words: 32 seeded prompts of 16 token ids
        prompts = prompts_for(32, 16, 30000)
    prompts = prompts[:8] if args.quick else prompts
    rows = []
    with tempfile.TemporaryDirectory(prefix="tp-agreement-") as root:
        for name in models:
            rows.append(measure(name, args.moe_layers, prompts, Path(root)))
            print(markdown_table(rows[-1:], list(rows[-1])), flush=True)
    table = markdown_table(rows, list(rows[0]))
    print(table)
    save("tp_agreement" + ("_quick" if args.quick else ""), {"tokens": N_TOKENS, "logprob_tol": LOGPROB_TOL,
                                                             "rows": rows},
         "## Tensor parallelism on GPUs: TP = 2 (NCCL) vs TP = 1, against transformers' bf16-vs-float32 floor\n\n"
         f"{N_TOKENS} greedy tokens per prompt. `_same`: prompts whose tokens all agree; `_tokens`: mean share "
         "of tokens before the first difference. Random weights are transformers' initialisation (seed 0).\n\n"
         + table, args.out)
    if not all(r["bf16_ok"] and r["fp32_ok"] for r in rows):
        raise SystemExit("a model missed its target (bf16_ok / fp32_ok above)")


if __name__ == "__main__":
    main()
