"""CPU weight packing: the packed_linear op against float64 torch on every instruction set, and when
the engine packs (lossless bf16 only, unless asked), with the same greedy text either way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from hf_helpers import TINY_LLAMA, make_hf_model, save_hf_checkpoint
from pagedserve import LLM, SamplingParams, ops
from pagedserve.models.model_config import ModelConfig
from pagedserve.models import build_model
from pagedserve.models.cpu_weight_packing import is_bf16_exact, pack_cpu_weights
from pagedserve.models.layers import Linear


@pytest.mark.parametrize("rows,out_features,in_features", [(1, 16, 32), (5, 33, 7), (16, 960, 576), (17, 100, 65),
                                                           (130, 48, 96), (0, 16, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_float64(cpu_isa, rows, out_features, in_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.1
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    out = torch.full((rows, out_features), float("nan"))
    ops.packed_linear(out, x, ops.pack_linear_weight(weight), bias)
    rounded = weight.to(torch.bfloat16).double()
    expected = F.linear(x.double(), rounded, None if bias is None else bias.double())
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5 * max(1.0, in_features ** 0.5))


@pytest.mark.parametrize("rows,out_features,in_features", [(1, 80, 576), (2, 48, 65), (13, 40, 65), (64, 16, 96)])
def test_packed_linear_is_one_fma_at_a_time_in_k_order(cpu_isa, rows, out_features, in_features):
    """The AVX2 and AVX-512 kernels (and the portable loop where the compiler fuses its multiply-adds) add each
    output's products in K order, one fused multiply-add each, whatever their row blocks: so every row's result
    is bit for bit that of a plain loop, alone or in any batch. (AMX splits x into three bf16 terms and the
    baseline level has no FMA: both differ in the last bits.)"""
    if cpu_isa in ("amx", "baseline"):
        pytest.skip(f"{cpu_isa} rounds differently by design")
    generator = torch.Generator().manual_seed(rows + in_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=generator)
    out = torch.empty(rows, out_features)
    ops.packed_linear(out, x, ops.pack_linear_weight(weight.float()), bias)
    # One float32 rounding per step: the bf16 x float32 product and the float32 sum are exact in float64 but for
    # (probability ~2**-29 a step) a double rounding.
    acc = torch.zeros(rows, out_features, dtype=torch.float64)
    w, xs = weight.double(), x.double()
    for k in range(in_features):
        acc = (xs[:, k:k + 1] * w[:, k] + acc).float().double()
    expected = (acc.float() + bias).float()
    assert torch.equal(out, expected)
    alone = torch.empty(1, out_features)
    ops.packed_linear(alone, x[-1:], ops.pack_linear_weight(weight.float()), bias)
    assert torch.equal(alone, out[-1:])


def test_packed_linear_is_float32_exact_in_the_activations():
    """x is not rounded to bf16 anywhere (the AMX kernel splits it into three bf16 terms):
    a weight of ones sums x to float32 accuracy, far below bf16's 2**-8."""
    x = torch.randn(4, 64, dtype=torch.float64)
    out = torch.empty(4, 16)
    ops.packed_linear(out, x.float(), ops.pack_linear_weight(torch.ones(16, 64)))
    expected = x.float().double().sum(-1, keepdim=True).expand(4, 16)
    assert (out.double() - expected).abs().max() < 1e-5


def test_packed_linear_rejects_bad_arguments():
    packed = ops.pack_linear_weight(torch.randn(32, 64))
    with pytest.raises(ValueError, match="packed_linear: x"):
        ops.packed_linear(torch.empty(2, 32), torch.randn(2, 64, dtype=torch.bfloat16), packed)
    with pytest.raises(ValueError, match="packed_weight"):
        ops.packed_linear(torch.empty(2, 48), torch.randn(2, 64), packed)
    with pytest.raises(ValueError, match="packed_linear: bias"):
        ops.packed_linear(torch.empty(2, 32), torch.randn(2, 64), packed, torch.randn(31))


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    """The same tiny Llama twice: with bf16-valued weights and with float32 ones."""
    hf_model = make_hf_model(LlamaConfig, seed=3, **TINY_LLAMA)
    exact_dir = tmp_path_factory.mktemp("float32_weights")
    save_hf_checkpoint(hf_model, exact_dir)
    with torch.no_grad():
        for param in hf_model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    bf16_dir = tmp_path_factory.mktemp("bf16_valued_weights")
    save_hf_checkpoint(hf_model, bf16_dir)
    return {"bf16_valued": bf16_dir, "float32": exact_dir}


def _build(path):
    return build_model(ModelConfig.from_model_dir(path, dtype="float32", device="cpu"), "cpu")


def _packed(model) -> bool:
    return all(m.kernel is not None for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head)


@pytest.mark.parametrize("checkpoint,mode,expect_packed", [
    ("bf16_valued", "auto", True), ("float32", "auto", False), ("float32", "bfloat16", True),
    ("bf16_valued", "float32", False)])
def test_pack_modes(tiny_checkpoints, checkpoint, mode, expect_packed):
    model = _build(tiny_checkpoints[checkpoint])
    assert pack_cpu_weights(model, mode) is expect_packed
    assert _packed(model) is expect_packed
    assert (model.lm_head_kernel is not None) is expect_packed


def test_pack_needs_float32_compute_and_a_known_mode(tiny_checkpoints):
    model = build_model(ModelConfig.from_model_dir(tiny_checkpoints["bf16_valued"], dtype="bfloat16", device="cpu"),
                        "cpu")
    assert not pack_cpu_weights(model, "auto")
    with pytest.raises(ValueError, match="cpu_weight_dtype 'int4'"):
        pack_cpu_weights(_build(tiny_checkpoints["bf16_valued"]), "int4")


def test_is_bf16_exact():
    assert is_bf16_exact(torch.tensor([1.0, -0.5, 3.0]))
    assert not is_bf16_exact(torch.tensor([1.0 + 2 ** -12]))


def test_engine_greedy_text_is_the_same_packed_or_not(tiny_checkpoints):
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for mode in ("auto", "float32"):
        llm = LLM(str(tiny_checkpoints["bf16_valued"]), device="cpu", dtype="float32", cpu_weight_dtype=mode,
                  max_model_len=128)
        assert _packed(llm.llm_engine.worker.model) is (mode == "auto")
        outputs[mode] = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert outputs["auto"] == outputs["float32"]


def test_engine_restores_torch_threads(tiny_checkpoints):
    before = torch.get_num_threads()
    llm = LLM(str(tiny_checkpoints["bf16_valued"]), device="cpu", max_model_len=128)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert torch.get_num_threads() == before
    llm.shutdown()
