"""Every family (dense and MoE) and RoPE type on a CUDA GPU, on random weights: float32 on the GPU equals the
CPU path (tokens identical, logprobs within 1e-4) and transformers' float32; bf16 on the GPU agrees with
transformers' bf16 on the same GPU as closely as transformers' bf16 agrees with its own float32.

The cases are test_model_families.py's, reshaped for the CUDA kernels (head dim 64, blocks of 16).
Skipped where no GPU (or no CUDA build) is present; scripts/gpu_check.sh runs it.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from hf_helpers import make_hf_model
from pagedserve import LLM, SamplingParams, _core
from test_model_families import DENSE_CASES, prompts
from test_moe_families import CASES as MOE_CASES
from test_moe_families import COMMON as MOE_COMMON
from test_moe_families import _config_classes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and _core.has_cuda), reason="needs a CUDA GPU and USE_CUDA=ON"),
]

GPU_SHAPE = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 num_hidden_layers=3, vocab_size=256, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2)
NEW_TOKENS = 24


def _resized_rope(params: dict, rotary_half: int) -> dict:
    """longrope factor lists stretched to this head size's rotary_dim / 2 entries."""
    out = dict(params)
    for key in ("short_factor", "long_factor"):
        if key in out:
            values = torch.tensor(out[key], dtype=torch.float64)
            out[key] = torch.nn.functional.interpolate(values[None, None], size=rotary_half, mode="linear",
                                                       align_corners=True)[0, 0].tolist()
    return out


def hf_model_for_gpu(name: str):
    import transformers

    if name in MOE_CASES:
        family, overrides = MOE_CASES[name]
        overrides = {k: v for k, v in overrides.items() if k != "head_dim"}
        return make_hf_model(_config_classes()[family], seed=zlib.crc32(name.encode()) % 1000,
                             **{**MOE_COMMON, **GPU_SHAPE, **overrides, "intermediate_size": 384})
    class_name, overrides = DENSE_CASES[name]
    overrides = dict(overrides)
    rope = overrides.get("rope_parameters")
    if isinstance(rope, dict) and "short_factor" in rope:
        partial = rope.get("partial_rotary_factor", 1.0)
        overrides["rope_parameters"] = _resized_rope(rope, int(GPU_SHAPE["head_dim"] * partial) // 2)
    return make_hf_model(getattr(transformers, class_name), seed=zlib.crc32(name.encode()) % 1000,
                         **{**GPU_SHAPE, **overrides})


def _run(path, device: str, dtype: str):
    # An explicit pool: no profiling, and nothing depends on what earlier engines of this process still hold.
    llm = LLM(str(path), device=device, dtype=dtype, seed=0, block_size=16, max_num_seqs=8, max_model_len=256,
              num_kv_blocks=256)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()[:5]], params, use_tqdm=False)
    del llm
    torch.cuda.empty_cache()
    return [(o.outputs[0].token_ids, [e[t].logprob for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


@pytest.mark.parametrize("name", list(DENSE_CASES) + list(MOE_CASES))
def test_float32_on_cuda_equals_the_cpu_path(name, tmp_path):
    model = hf_model_for_gpu(name)
    model.save_pretrained(tmp_path)
    cpu, cuda = _run(tmp_path, "cpu", "float32"), _run(tmp_path, "cuda", "float32")
    for (cpu_tokens, cpu_lp), (gpu_tokens, gpu_lp) in zip(cpu, cuda):
        # Identical up to a near-tie at most: where the greedy choice differs, both chosen tokens had the same
        # logprob within float32 noise (the two devices sum in different orders), and everything before it agrees.
        same = next((i for i, (a, b) in enumerate(zip(cpu_tokens, gpu_tokens)) if a != b), len(cpu_tokens))
        torch.testing.assert_close(torch.tensor(gpu_lp[:same]), torch.tensor(cpu_lp[:same]), rtol=0, atol=1e-4)
        if same < len(cpu_tokens):
            assert abs(gpu_lp[same] - cpu_lp[same]) < 1e-4, (name, same, "a real difference, not a tie")


@pytest.mark.parametrize("name", list(DENSE_CASES) + list(MOE_CASES))
def test_bf16_on_cuda_agrees_with_transformers_bf16(name, tmp_path):
    """First-step greedy tokens and logprobs: ours in bf16 vs transformers bf16 on this GPU, against
    transformers' own bf16-vs-float32 gap on the same prompts."""
    model = hf_model_for_gpu(name)
    model.save_pretrained(tmp_path)
    ours = _run(tmp_path, "cuda", "bfloat16")
    hf32 = model.to("cuda", torch.float32)
    ref32 = [hf32(torch.tensor([p], device="cuda")).logits[0, -1].float().log_softmax(-1) for p in prompts()[:5]]
    hf16 = model.to("cuda", torch.bfloat16)
    ref16 = [hf16(torch.tensor([p], device="cuda")).logits[0, -1].float().log_softmax(-1) for p in prompts()[:5]]
    for (tokens, lps), lp32, lp16 in zip(ours, ref32, ref16):
        first = tokens[0]
        hf_gap = (lp16[first] - lp32[first]).abs().item()
        our_gap = abs(lps[0] - lp32[first].item())
        # Top-k routing turns bf16 rounding into a different expert now and then: MoE gets a wider bound.
        assert our_gap <= max(4 * hf_gap, 0.25 if name in MOE_CASES else 0.1), (name, our_gap, hf_gap)


# Head dim 128: on Hopper the wgmma prefill kernel (cuda/prefill_attention_wgmma.cuh) with its windows and
# soft-capping; prompts over several of its 128-key tiles, prefilled in chunks of 128 tokens.
HEAD_DIM_128_CASES = ["qwen3_qk_norm_bias", "gemma2", "llama_rope_llama3"]
LONG_PROMPT_LENGTHS = (300, 170, 129, 64, 9)


@pytest.mark.parametrize("name", HEAD_DIM_128_CASES)
def test_bf16_head_dim_128_long_prompts_agree_with_transformers_bf16(name, tmp_path):
    import transformers

    class_name, overrides = DENSE_CASES[name]
    model = make_hf_model(getattr(transformers, class_name), seed=zlib.crc32(name.encode()) % 1000,
                          **{**GPU_SHAPE, "head_dim": 128, "max_position_embeddings": 512, **overrides})
    model.save_pretrained(tmp_path)
    generator = torch.Generator().manual_seed(5)
    long_prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in LONG_PROMPT_LENGTHS]
    llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", seed=0, block_size=16, max_num_seqs=8,
              max_model_len=512, num_kv_blocks=256, max_num_batched_tokens=128)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in long_prompts], params, use_tqdm=False)
    del llm
    torch.cuda.empty_cache()
    hf32 = model.to("cuda", torch.float32)
    ref32 = [hf32(torch.tensor([p], device="cuda")).logits[0, -1].float().log_softmax(-1) for p in long_prompts]
    hf16 = model.to("cuda", torch.bfloat16)
    ref16 = [hf16(torch.tensor([p], device="cuda")).logits[0, -1].float().log_softmax(-1) for p in long_prompts]
    for out, lp32, lp16, n in zip(outs, ref32, ref16, LONG_PROMPT_LENGTHS):
        first = out.outputs[0].token_ids[0]
        hf_gap = (lp16[first] - lp32[first]).abs().item()
        our_gap = abs(out.outputs[0].logprobs[0][first].logprob - lp32[first].item())
        assert our_gap <= max(4 * hf_gap, 0.1), (name, n, our_gap, hf_gap)
        assert lp32[first] >= lp32.max() - 0.1, (name, n, "greedy token far from float32's best")
