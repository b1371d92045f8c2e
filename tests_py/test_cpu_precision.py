"""cpu_precision: the bf16-activation kernel (ops.packed_linear_bf16) against float64 torch on every
instruction set this CPU has, and the mode's resolution and plumbing (engine_config.resolve_cpu_precision,
pack_cpu_weights): explicit dtype float32 keeps the exact path, bfloat16 routes every linear and the LM head
through PackedBf16Activations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from hf_helpers import TINY_LLAMA, make_hf_model, save_hf_checkpoint
from pagedserve import LLM, SamplingParams, ops
from pagedserve.engine_config import EngineConfig, resolve_defaults
from pagedserve.models.layers import Linear
from pagedserve.models.linear_kernels import PackedBf16, PackedBf16Activations

HAS_BF16_DOT = ops.cpu_kernels()["bfloat16"] in ("avx512_bf16", "amx_bf16")


def _bf16_oracle(x, weight, bias):
    """float64 products of the bf16-rounded x and W, and the float32 summation bound K 2^-24 sum |x w|."""
    xr, wr = x.to(torch.bfloat16).double(), weight.to(torch.bfloat16).double()
    expected = F.linear(xr, wr, None if bias is None else bias.double())
    magnitude = F.linear(xr.abs(), wr.abs(), None if bias is None else bias.double().abs())
    return expected, (x.shape[1] + 2) * 2.0 ** -24 * magnitude


@pytest.mark.parametrize("rows,out_features,in_features", [(1, 16, 32), (3, 33, 7), (1, 960, 576), (17, 100, 65),
                                                           (130, 48, 96), (0, 16, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_bf16_matches_float64(cpu_isa, rows, out_features, in_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.1
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    packed = ops.pack_linear_weight(weight)
    expected, bound = _bf16_oracle(x, weight, bias)
    out = torch.full((rows, out_features), float("nan"))
    ops.packed_linear_bf16(out, x, packed, bias)
    assert ((out.double() - expected).abs() <= bound).all()
    from_bf16 = torch.full((rows, out_features), float("nan"))
    ops.packed_linear_bf16(from_bf16, x.to(torch.bfloat16), packed, bias)
    assert torch.equal(from_bf16, out)
    out_bf16 = torch.empty(rows, out_features, dtype=torch.bfloat16)
    ops.packed_linear_bf16(out_bf16, x, packed, bias)
    assert torch.equal(out_bf16, out.to(torch.bfloat16))


def test_packed_linear_bf16_rounds_the_activations():
    """Unlike packed_linear: x = 1 + 2^-10 rounds to 1 in bf16, so a weight of ones sums to exactly K."""
    x = torch.full((2, 64), 1.0 + 2.0 ** -10)
    out = torch.empty(2, 16)
    ops.packed_linear_bf16(out, x, ops.pack_linear_weight(torch.ones(16, 64)))
    assert torch.equal(out, torch.full((2, 16), 64.0))


def test_packed_linear_bf16_threads_bit_identical():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(37, 576, generator=generator)
    packed = ops.pack_linear_weight(torch.randn(1000, 576, generator=generator) * 0.05)
    before = ops.num_threads()
    results = []
    for threads in (1, 2, 4):
        ops.set_num_threads(threads)
        out = torch.empty(37, 1000)
        ops.packed_linear_bf16(out, x, packed)
        results.append(out)
    ops.set_num_threads(before)
    assert all(torch.equal(r, results[0]) for r in results)


def test_packed_linear_bf16_rejects_bad_arguments():
    packed = ops.pack_linear_weight(torch.randn(32, 64))
    with pytest.raises(ValueError, match="packed_linear_bf16: x must be float32 or bfloat16"):
        ops.packed_linear_bf16(torch.empty(2, 32), torch.randn(2, 64, dtype=torch.float16), packed)
    with pytest.raises(ValueError, match="packed_weight"):
        ops.packed_linear_bf16(torch.empty(2, 48), torch.randn(2, 64), packed)


def test_cpu_kernels_names_each_precision():
    kernels = ops.cpu_kernels()
    assert kernels["float32"] in ("amx_bf16x3", "avx512_fma", "avx2_fma", "baseline")
    assert kernels["int8"] in ("amx_int8 (avx512_vnni below 7 rows)", "avx512_vnni", "avx2_maddubs", "baseline_int32")
    assert kernels["bfloat16"] in ("amx_bf16", "avx512_bf16", "avx512_widened", "avx2_widened", "baseline_widened")
    assert (kernels["bfloat16"] == "avx512_bf16") == (ops.cpu_isa() == "avx512_bf16")


def _resolved(checkpoint_is_bf16=True, device="cpu", **options):
    return resolve_defaults(EngineConfig(**options), device, 2048, checkpoint_is_bf16=checkpoint_is_bf16).cpu_precision


def test_resolution_rule():
    assert _resolved() == ("bfloat16" if HAS_BF16_DOT else "float32")
    assert _resolved(dtype="float32") == "float32"  # what every exactness test passes
    assert _resolved(checkpoint_is_bf16=False) == "float32"  # rounding float32 weights is not auto's to do
    assert _resolved(cpu_weight_dtype="float32") == "float32"
    assert _resolved(cpu_precision="bfloat16", dtype="float32") == "bfloat16"
    assert _resolved(cpu_precision="float32") == "float32"
    assert _resolved(device="cuda") == "float32"
    with pytest.raises(ValueError, match="cpu_precision 'bfloat16'.*dtype auto or float32"):
        _resolved(cpu_precision="bfloat16", dtype="bfloat16")
    with pytest.raises(ValueError, match="runs on the CPU only"):
        _resolved(device="cuda", quantization="int8")


@pytest.fixture(scope="module")
def tiny_bf16_checkpoint(tmp_path_factory):
    hf_model = make_hf_model(LlamaConfig, seed=3, **TINY_LLAMA).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("tiny_bf16")
    save_hf_checkpoint(hf_model, path)
    return path


def _kernels(llm):
    model = llm.llm_engine.worker.model
    kinds = {type(m.kernel) for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head}
    return kinds, type(model.lm_head_kernel)


def test_engine_modes_route_their_kernels(tiny_bf16_checkpoint):
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    texts = {}
    for precision in ("float32", "bfloat16"):
        llm = LLM(str(tiny_bf16_checkpoint), device="cpu", dtype="float32", cpu_precision=precision,
                  max_model_len=128)
        assert llm.llm_engine.config.cpu_precision == precision
        kernel = PackedBf16Activations if precision == "bfloat16" else PackedBf16
        assert _kernels(llm) == ({kernel}, kernel)
        texts[precision] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert all(len(t) == 8 for t in texts["bfloat16"])
