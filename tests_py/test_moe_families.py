"""Mixture-of-Experts families (Mixtral, Qwen2-MoE, Qwen3-MoE): their checkpoints and layer layouts.

The cases below also run through test_model_families.py's battery (whole and chunked prefills, 32 greedy
tokens, prefix-cache hits, preemption, against transformers). Here, tiny random checkpoints (float32, CPU):
which layers are sparse, the expert layouts checkpoints use (per-expert tensors, transformers 5's fused 3D
tensors, .bin files), the packed-bf16 CPU path and dummy weights.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from safetensors.torch import save_file

from hf_helpers import make_hf_model, round_to_bf16
from pagedserve import LLM, SamplingParams
from pagedserve.models import build_model
from pagedserve.models.model_config import ModelConfig
from pagedserve.models.moe import SparseMoeBlock

TOL = 1e-4  # absolute, float32 logprobs
COMMON = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
              max_position_embeddings=128, tie_word_embeddings=False)


def _config_classes():
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    return {"mixtral": MixtralConfig, "qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig}


# name -> (family, config overrides)
CASES = {
    "mixtral_8x2": ("mixtral", dict(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                                    sliding_window=None)),
    "qwen2_moe_shared_dense_layer": ("qwen2_moe", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=6,
                                                       num_experts_per_tok=2, shared_expert_intermediate_size=80,
                                                       mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3_moe_norm_topk_sparse_step": ("qwen3_moe", dict(intermediate_size=96, moe_intermediate_size=32,
                                                          num_experts=8, num_experts_per_tok=3, head_dim=32,
                                                          norm_topk_prob=True, decoder_sparse_step=2)),
    "mixtral_top1_window": ("mixtral", dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=1,
                                            sliding_window=8)),
}
# which layers are sparse, per case
SPARSE_LAYERS = {"mixtral_8x2": [True] * 3, "qwen2_moe_shared_dense_layer": [True, False, True],
                 "qwen3_moe_norm_topk_sparse_step": [False, True, False], "mixtral_top1_window": [True] * 3}


def hf_moe_model(name: str, bf16_exact: bool = False):
    family, overrides = CASES[name]
    model = make_hf_model(_config_classes()[family], seed=zlib.crc32(name.encode()) % 1000, **{**COMMON, **overrides})
    return round_to_bf16(model) if bf16_exact else model


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (length,), generator=generator).tolist() for length in (23, 5, 40, 1, 17)]


def hf_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def hf_greedy(hf_model, prompt: list[int], num_tokens: int) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])  # an explicit mask: generate would mask a prompt token equal to pad_token_id
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                                min_new_tokens=num_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def check_against_hf(hf_model, path, tol: float = TOL, new_tokens: int = 6, **options) -> LLM:
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4, max_num_seqs=8, num_kv_blocks=128, **options)
    batch = prompts()
    # min_tokens masks EOS exactly as transformers' min_new_tokens does (ignore_eos would not mask it)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, prompt_logprobs=0,
                            logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for prompt, out in zip(batch, outs):
        expected = hf_logprobs(hf_model, prompt)
        for i in range(1, len(prompt)):
            got = out.prompt_logprobs[i][prompt[i]].logprob
            assert got == pytest.approx(expected[i - 1, prompt[i]].item(), abs=tol), (len(prompt), i)
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, new_tokens), len(prompt)
        full = prompt + out.outputs[0].token_ids
        reference = hf_logprobs(hf_model, full)
        for step, (token, entry) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
            assert entry[token].logprob == pytest.approx(reference[len(prompt) - 1 + step, token].item(), abs=tol)
    return llm


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, tmp_path_factory):
    hf_model = hf_moe_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(path)
    return request.param, hf_model, path


def moe_blocks(llm: LLM) -> list[SparseMoeBlock]:
    return [m for m in llm.llm_engine.worker.model.modules() if isinstance(m, SparseMoeBlock)]


def test_sparse_layers_and_unpacked_float32_experts(saved):
    name, _, path = saved
    model = build_model(ModelConfig.from_model_dir(path, dtype="float32", device="cpu"), "cpu")
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers] == SPARSE_LAYERS[name]
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(block.experts.packed is None for block in blocks)  # random float32 weights: not packed
    if name == "mixtral_top1_window":
        assert all(layer.self_attn.attn.extra["window"] == 8 for layer in model.model.layers)


def test_fused_3d_expert_checkpoint_loads_the_same(saved, tmp_path):
    """transformers 5 holds experts as gate_up_proj [E, 2I, H] / down_proj [E, H, I]; a checkpoint may too."""
    name, hf_model, path = saved
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    per_expert = build_model(ModelConfig.from_model_dir(path, dtype="float32", device="cpu"), "cpu")
    fused = build_model(ModelConfig.from_model_dir(tmp_path, dtype="float32", device="cpu"), "cpu")
    for (a_name, a), (b_name, b) in zip(per_expert.named_parameters(), fused.named_parameters()):
        assert a_name == b_name and torch.equal(a, b), a_name


def test_bin_checkpoint_with_per_expert_names(saved, tmp_path):
    name, hf_model, path = saved
    from safetensors.torch import load_file

    state = load_file(str(path / "model.safetensors"))
    assert any(".experts.0." in k for k in state)  # save_pretrained writes the classic per-expert names
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    check_against_hf(hf_model, tmp_path, new_tokens=3)


@pytest.mark.parametrize("name", ["mixtral_8x2", "qwen2_moe_shared_dense_layer"])
def test_packed_bf16_cpu_path(name, tmp_path):
    """bf16-exact weights: "auto" packs every linear and expert as bf16 tiles; results as transformers' float32."""
    hf_model = hf_moe_model(name, bf16_exact=True)
    hf_model.save_pretrained(tmp_path)
    llm = check_against_hf(hf_model, tmp_path, tol=2e-4, max_num_batched_tokens=16)
    assert moe_blocks(llm) and all(block.experts.packed is not None for block in moe_blocks(llm))


@pytest.mark.parametrize("name", list(CASES))
def test_dummy_weights_give_finite_logits(name, tmp_path):
    hf_moe_model(name).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()  # the config alone
    llm = LLM(str(tmp_path), load_format="dummy", dtype="bfloat16", device="cpu", block_size=4, num_kv_blocks=64)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts()[:3]],
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0), use_tqdm=False)
    for o in out:
        assert len(o.outputs[0].token_ids) == 4
        assert all(torch.isfinite(torch.tensor(e[t].logprob)) for t, e in zip(o.outputs[0].token_ids,
                                                                               o.outputs[0].logprobs))


def test_moe_config_fields():
    from pagedserve.models.moe_config import parse_moe

    raw = {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 2,
           "mlp_only_layers": [3], "norm_topk_prob": True}
    moe = parse_moe(raw, "Qwen3MoeForCausalLM", 6)
    assert moe.sparse_layers == (False, True, False, False, False, True) and moe.renormalize
    assert moe.shared_expert_intermediate_size == 0
    mixtral = parse_moe({"num_local_experts": 4, "intermediate_size": 40}, "MixtralForCausalLM", 2)
    assert (mixtral.num_experts, mixtral.top_k, mixtral.intermediate_size, mixtral.renormalize) == (4, 2, 40, True)
    assert parse_moe({}, "LlamaForCausalLM", 2) is None
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        parse_moe({**raw, "num_experts_per_tok": 7}, "Qwen3MoeForCausalLM", 6)
