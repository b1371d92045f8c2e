"""Why greedy bf16 text differs from transformers bf16 on the same GPU, measured.

For the 32 prompts of the GPU agreement test (pagedserve.testing.agreement),
16 greedy tokens each, transformers bf16 (sdpa) one prompt at a time is the
reference. Reported side by side:
  - transformers against itself: float32, and bf16 with eager attention (the noise floor);
  - pagedserve bf16 with all 32 prompts in one batch, one prompt at a time
    (transformers' own batch size), and one at a time without CUDA graphs;
  - for every prompt that differs: the first differing step and transformers'
    top-2 logit gap there (a near-tie flips on rounding noise);
  - first-step logits: how many prompts match transformers bit for bit;
  - for the first prompt whose first-step logits differ, the first layer that
    differs, sub-layer by sub-layer (norm, q, k, v, attention output, o_proj,
    MLP): where the two computations first differ in a single bit;
  - the SDPA backend torch picks for transformers' prefill and decode shapes.

    python bench/numerics/bf16_agreement.py [--out DIR]      (needs a CUDA GPU and the CUDA build)
    python bench/numerics/bf16_agreement.py --quick          # the first 8 prompts, the first 2 layers probed
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.report import arg_parser, markdown_table, require_cuda, save  # noqa: E402

from pagedserve.testing.agreement import N_TOKENS, agreement_prompts, first_step_logits, hf_greedy  # noqa: E402


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def compare(name, ours, want, scores):
    diverging = []
    for i, (a, b) in enumerate(zip(ours, want)):
        step = first_difference(a, b)
        if step is not None:
            top2 = scores[i][step].topk(2).values
            diverging.append({"prompt": i, "step": step, "hf_top2_gap": round(float(top2[0] - top2[1]), 4)})
    return {"variant": name, "agree": len(want) - len(diverging), "diverging": diverging}


def ours_greedy(llm, prompts, one_at_a_time):
    from pagedserve import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, min_tokens=N_TOKENS)
    batches = [[p] for p in prompts] if one_at_a_time else [prompts]
    outs = []
    for batch in batches:
        res = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        outs += [r.outputs[0].token_ids for r in res]
    return outs


def capture(modules: dict, pre: set):
    """Registers hooks that record each named module's output (or input, for names in pre)."""
    seen, handles = {}, []
    for name, module in modules.items():
        if name in pre:
            handles.append(module.register_forward_pre_hook(lambda m, args, n=name: seen.__setitem__(n, args[0].clone())))
        else:
            handles.append(module.register_forward_hook(lambda m, args, out, n=name: seen.__setitem__(n, out.clone())))
    return seen, handles


def layer_probe(llm, hf, prompt, index):
    """Bitwise comparison of layer `index`'s pieces for one prompt's prefill."""
    ours_layer = llm.llm_engine.worker.model.model.layers[index]
    hf_layer = hf.model.layers[index]
    attn_args = {}
    h0 = ours_layer.self_attn.attn.register_forward_pre_hook(
        lambda m, args: attn_args.update(q=args[0].clone(), k=args[1].clone(), v=args[2].clone()))
    ours_seen, h1 = capture({"qkv_in": ours_layer.self_attn.qkv_proj, "gate_up_in": ours_layer.mlp.gate_up_proj,
                             "qkv": ours_layer.self_attn.qkv_proj, "attn_out": ours_layer.self_attn.o_proj,
                             "o_proj": ours_layer.self_attn.o_proj, "gate_up": ours_layer.mlp.gate_up_proj,
                             "down_in": ours_layer.mlp.down_proj, "down": ours_layer.mlp.down_proj},
                            pre={"attn_out", "down_in", "qkv_in", "gate_up_in"})
    hf_seen, h2 = capture({"q_in": hf_layer.self_attn.q_proj, "gate_in": hf_layer.mlp.gate_proj,
                           "q": hf_layer.self_attn.q_proj, "k": hf_layer.self_attn.k_proj,
                           "v": hf_layer.self_attn.v_proj, "attn_out": hf_layer.self_attn.o_proj,
                           "o_proj": hf_layer.self_attn.o_proj, "gate": hf_layer.mlp.gate_proj,
                           "up": hf_layer.mlp.up_proj, "down_in": hf_layer.mlp.down_proj, "down": hf_layer.mlp.down_proj},
                          pre={"attn_out", "down_in", "q_in", "gate_in"})
    with torch.inference_mode():
        first_step_logits(llm, prompt)
        hf(torch.tensor([prompt], device="cuda"))
    for h in h1 + h2 + [h0]:
        h.remove()
    cfg = llm.llm_engine.worker.model.config
    q, k, v = ours_seen["qkv"].split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
    gate, up = ours_seen["gate_up"].chunk(2, dim=-1)
    pairs = {"input_layernorm": (ours_seen["qkv_in"], hf_seen["q_in"]), "q_proj": (q, hf_seen["q"]), "k_proj": (k, hf_seen["k"]), "v_proj": (v, hf_seen["v"]),
             "attention output": (ours_seen["attn_out"], hf_seen["attn_out"]),
             "post_attention_layernorm": (ours_seen["gate_up_in"], hf_seen["gate_in"]),
             "o_proj": (ours_seen["o_proj"], hf_seen["o_proj"]), "gate_proj": (gate, hf_seen["gate"]),
             "up_proj": (up, hf_seen["up"]), "silu(gate)*up": (ours_seen["down_in"], hf_seen["down_in"]),
             "down_proj": (ours_seen["down"], hf_seen["down"])}
    # Would unmerged GEMMs (transformers' shapes) reproduce its projections bit for bit?
    qkv_w = ours_layer.self_attn.qkv_proj.weight
    gate_up_w = ours_layer.mlp.gate_up_proj.weight
    with torch.inference_mode():
        q_w, k_w, v_w = qkv_w.split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=0)
        g_w, u_w = gate_up_w.chunk(2, dim=0)
        pairs["q_proj, unmerged GEMM"] = (torch.nn.functional.linear(ours_seen["qkv_in"], q_w), hf_seen["q"])
        pairs["k_proj, unmerged GEMM"] = (torch.nn.functional.linear(ours_seen["qkv_in"], k_w), hf_seen["k"])
        pairs["gate_proj, unmerged GEMM"] = (torch.nn.functional.linear(ours_seen["gate_up_in"], g_w), hf_seen["gate"])
        # Our attention kernel vs torch SDPA on the same (post-rope) q, k, v.
        q = attn_args["q"].transpose(0, 1)[None]
        k = attn_args["k"].transpose(0, 1)[None]
        v = attn_args["v"].transpose(0, 1)[None]
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        pairs["attention kernel, vs SDPA on the same q/k/v"] = (ours_seen["attn_out"], ref[0].transpose(0, 1))
    rows = []
    for name, (a, b) in pairs.items():
        a, b = a.reshape(-1).float(), b.reshape(-1).float()
        rows.append({"piece": name, "elements": a.numel(), "bitwise_equal": int((a == b).sum()),
                     "max_abs_diff": float((a - b).abs().max())})
    return rows


def sdpa_choices(cfg, prompt_len):
    names = {int(v): k for k, v in vars(torch.nn.attention.SDPBackend).items() if not k.startswith("_")
             and isinstance(v, torch.nn.attention.SDPBackend)} if hasattr(torch.nn.attention, "SDPBackend") else {}
    out = {}
    for label, q_len, causal in (("prefill", prompt_len, True), ("decode", 1, False)):
        # As transformers calls it without a mask: kv heads as they are, enable_gqa.
        q = torch.randn(1, cfg.num_heads, q_len, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, cfg.num_kv_heads, prompt_len, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
        choice = torch._fused_sdp_choice(q, k, k, None, 0.0, causal, enable_gqa=True)
        out[label] = names.get(int(choice), str(choice))
    return out


def main() -> None:
    ap = arg_parser(__doc__, "the first 8 prompts; probe at most 2 layers")
    args = ap.parse_args()
    require_cuda(__file__)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedserve import LLM
    from pagedserve.models.default_model import default_model_dir

    path = default_model_dir()
    prompts = agreement_prompts(AutoTokenizer.from_pretrained(path))[:8 if args.quick else None]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    want, scores = hf_greedy(hf, prompts, scores=True)
    variants = []
    for name, kwargs in (("transformers float32", dict(dtype=torch.float32)),
                         ("transformers bf16, eager attention", dict(dtype=torch.bfloat16,
                                                                     attn_implementation="eager"))):
        other = AutoModelForCausalLM.from_pretrained(path, **kwargs).cuda().eval()
        variants.append(compare(name, hf_greedy(other, prompts)[0], want, scores))
        del other
    llm = LLM(str(path), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.4)
    variants.append(compare(f"pagedserve bf16, {len(prompts)} prompts batched", ours_greedy(llm, prompts, False),
                            want, scores))
    variants.append(compare("pagedserve bf16, one prompt at a time", ours_greedy(llm, prompts, True), want, scores))
    llm.shutdown()
    # transformers' shapes exactly: a prefill of the whole prompt (no cached prefix), then M = 1 decodes.
    alone = LLM(str(path), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.2, enable_prefix_caching=False)
    variants.append(compare("pagedserve bf16, one at a time, no prefix cache", ours_greedy(alone, prompts, True),
                            want, scores))
    exact, max_diff, first_inexact = 0, 0.0, None
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            mine = first_step_logits(alone, p)
            theirs = hf(torch.tensor([p], device="cuda")).logits[0, -1].float()
            same = torch.equal(mine, theirs)
            exact += int(same)
            if not same and first_inexact is None:
                first_inexact = i
            max_diff = max(max_diff, float((mine - theirs).abs().max()))
    # Walk the layers of the first prompt whose first-step logits differ: the first piece that
    # differs in the first layer that differs is where the computations part.
    probe_prompt = 0 if first_inexact is None else first_inexact
    probe_layer, probe = None, []
    for index in range(min(2, len(hf.model.layers)) if args.quick else len(hf.model.layers)):
        rows = layer_probe(alone, hf, prompts[probe_prompt], index)
        if any(r["bitwise_equal"] != r["elements"] for r in rows if "," not in r["piece"]):
            probe_layer, probe = index, rows
            break
    cfg = alone.llm_engine.worker.model.config
    alone.shutdown()
    eager = LLM(str(path), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.4, enforce_eager=True)
    variants.append(compare("pagedserve bf16, one at a time, no CUDA graphs", ours_greedy(eager, prompts, True),
                            want, scores))
    eager.shutdown()
    sdpa = sdpa_choices(cfg, len(prompts[0]))

    table = markdown_table([{**v, "diverging (prompt@step: hf top-2 gap)": ", ".join(
        f"{d['prompt']}@{d['step']}: {d['hf_top2_gap']}" for d in v["diverging"])} for v in variants],
        ["variant", "agree", "diverging (prompt@step: hf top-2 gap)"])
    text = (f"# bf16 greedy agreement with transformers bf16 (sdpa), {N_TOKENS} tokens, {len(prompts)} prompts\n\n"
            f"{table}\n\nFirst-step logits bit-identical to transformers: {exact}/{len(prompts)} prompts "
            f"(max abs diff {max_diff:.3g}).\n\n"
            f"SDPA backend transformers gets: {sdpa}\n\n" + (
                f"## Layer {probe_layer}, prompt {probe_prompt} (prefill, {len(prompts[probe_prompt])} tokens): "
                "the first layer that differs\n\n"
                + markdown_table(probe, ["piece", "elements", "bitwise_equal", "max_abs_diff"])
                if probe else f"Every sub-layer of every layer is bit-identical on prompt {probe_prompt}."))
    print(text)
    save("bf16_agreement" + ("_quick" if args.quick else ""),
         {"variants": variants, "first_step_exact": exact, "first_step_max_abs_diff": max_diff,
          "probe": {"prompt": probe_prompt, "layer": probe_layer, "pieces": probe}, "sdpa_backends": sdpa},
         text, args.out)


if __name__ == "__main__":
    main()
