"""quantization int8: quantize_int8_weight's values and layout, int8_linear against float64 loops of the same
quantization arithmetic on every instruction set this CPU has, and the default model with int8 weights: its
logits near the float32 model's, its greedy text mostly the same, its weights 1 byte per parameter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve import LLM, SamplingParams, ops
from pagedserve.models.int8_linear import Int8Linear
from pagedserve.models.layers import Linear
from pagedserve.testing.agreement import first_step_logits


def _unpack(weight: ops.Int8Weight, out_features: int, in_features: int) -> np.ndarray:
    """q [N, K] back from the packed words, read as the layout header states: byte j of packed[t, g, c] is
    q[16t + c, 4g + j] + 128."""
    tiles, groups, _ = weight.packed.shape
    raw = weight.packed.contiguous().view(torch.uint8).numpy().astype(np.int64).reshape(tiles, groups, 16, 4) - 128
    return raw.transpose(0, 2, 1, 3).reshape(tiles * 16, groups * 4)[:out_features, :in_features]


def test_quantize_int8_weight_values_and_layout():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(37, 70, generator=generator)
    weight[3] = 0.0  # a zero channel stays zero
    q = ops.quantize_int8_weight(weight)
    assert q.packed.shape == (3, 32, 16) and q.packed.dtype == torch.int32
    values = _unpack(q, 37, 70).astype(np.float64)
    scales = q.scales.double().numpy()
    np.testing.assert_allclose(scales, weight.abs().amax(1).double().numpy() / 127, rtol=1e-6)
    assert np.abs(values).max() == 127 and (values[3] == 0).all()
    error = np.abs(values * scales[:, None] - weight.double().numpy())
    assert (error <= scales[:, None] / 2 * (1 + 1e-5)).all()  # round to nearest
    padding = q.packed.view(torch.uint8).reshape(3, 32, 16, 4).permute(0, 2, 1, 3).reshape(48, 128)
    assert (padding[37:] == 128).all() and (padding[:, 70:] == 128).all()


def _oracle(x: torch.Tensor, q: ops.Int8Weight, n: int, k: int, bias):
    """x quantized per 64-block of each row as cpp/ops/int8_linear.cc states (float32 arithmetic), each block's
    integer products in int64; returns the result, and the float32 rounding bound of the kernel's sum."""
    xs = x.float().numpy()
    qw = _unpack(q, n, k).astype(np.int64)
    total = np.zeros((x.shape[0], n))
    magnitude = np.zeros((x.shape[0], n))
    blocks = 0
    for begin in range(0, k, 64):
        xb = xs[:, begin:begin + 64]
        amax = np.abs(xb).max(1, initial=0).astype(np.float32)
        inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
        qx = np.clip(np.rint((xb * inv[:, None]).astype(np.float32)), -127, 127).astype(np.int64)
        part = (qx @ qw[:, begin:begin + 64].T) * (amax / np.float32(127)).astype(np.float64)[:, None]
        total += part
        magnitude += np.abs(part)
        blocks += 1
    scales = q.scales.double().numpy()
    expected = total * scales + (0 if bias is None else bias.double().numpy())
    return expected, magnitude * scales * 2.0 ** -23 * (blocks + 3) + np.abs(expected) * 2.0 ** -23 + 1e-30


@pytest.mark.parametrize("rows,out_features,in_features", [(1, 16, 64), (3, 33, 7), (1, 960, 576), (17, 100, 65),
                                                           (130, 48, 96), (0, 16, 32), (5, 20, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_linear_matches_float64(cpu_isa, rows, out_features, in_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator)
    q = ops.quantize_int8_weight(torch.randn(out_features, in_features, generator=generator) * 0.1)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    out = torch.full((rows, out_features), float("nan"))
    ops.int8_linear(out, x, q, bias)
    expected, bound = _oracle(x, q, out_features, in_features, bias)
    assert (np.abs(out.double().numpy() - expected) <= bound).all()
    from_bf16 = torch.empty(rows, out_features)
    ops.int8_linear(from_bf16, x.to(torch.bfloat16), q, bias)
    expected, bound = _oracle(x.to(torch.bfloat16), q, out_features, in_features, bias)
    assert (np.abs(from_bf16.double().numpy() - expected) <= bound).all()


def test_int8_linear_threads_bit_identical():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(37, 576, generator=generator)
    q = ops.quantize_int8_weight(torch.randn(1000, 576, generator=generator))
    before = ops.num_threads()
    results = []
    for threads in (1, 2, 4):
        ops.set_num_threads(threads)
        out = torch.empty(37, 1000)
        ops.int8_linear(out, x, q)
        results.append(out)
    ops.set_num_threads(before)
    assert all(torch.equal(r, results[0]) for r in results)


def test_int8_linear_rows_bit_identical_in_any_batch_and_level():
    """Each row's result is the row alone's at every batch size (AMX hosts switch from VNNI to tiles at 7
    rows), and the same at every level from AVX2 up (exact integer sums, then vpdpbusd's float steps, FMA
    included; the baseline level has no FMA)."""
    from pagedserve import _core

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(40, 576, generator=generator)
    q = ops.quantize_int8_weight(torch.randn(200, 576, generator=generator))
    before, by_level = _core.ops.cpu_isa(), {}
    try:
        for level in _core.ops.supported_cpu_isas():
            _core.ops.set_cpu_isa(level)
            alone = torch.empty(40, 200)
            for row in range(40):
                ops.int8_linear(alone[row:row + 1], x[row:row + 1], q)
            for rows in (6, 7, 16, 40):
                out = torch.empty(rows, 200)
                ops.int8_linear(out, x[:rows], q)
                assert torch.equal(out, alone[:rows]), (level, rows)
            by_level[level] = alone
    finally:
        _core.ops.set_cpu_isa(before)
    fma_levels = [level for level in by_level if level != "baseline"]
    assert all(torch.equal(by_level[level], by_level[fma_levels[0]]) for level in fma_levels)


def test_int8_linear_rejects_bad_arguments():
    q = ops.quantize_int8_weight(torch.randn(32, 64))
    with pytest.raises(ValueError, match="int8_linear: x must be float32 or bfloat16"):
        ops.int8_linear(torch.empty(2, 32), torch.randn(2, 64, dtype=torch.float16), q)
    with pytest.raises(ValueError, match="packed_weight"):
        ops.int8_linear(torch.empty(2, 48), torch.randn(2, 64), q)
    with pytest.raises(ValueError, match="int8_linear: bias"):
        ops.int8_linear(torch.empty(2, 32), torch.randn(2, 64), q, torch.randn(31))


# The default model (SmolLM2-135M-Instruct) with int8 weights against the same model in float32.
PROMPTS = ["The capital of France is", "def quicksort(arr):", "Water boils at", "A list of prime numbers: 2, 3, 5,",
           "The mitochondria is", "In 1969, the first humans"]
# Measured on a Zen 4 (avx512_vnni), activation scales per 64-block: max |int8 - float32| first-step logit
# 2.29 (logits span -20..34), every first token equal, 75/96 greedy tokens before the first difference, 4/6
# prompts equal throughout (per-row activation scales: 3.75 and 44/96). The bounds leave room for other
# kernels' roundings and near-ties. Both engines keep a float32 KV cache (int8 weights would take a bf16
# one by default), so the difference is the weights' alone.
LOGIT_TOLERANCE = 3.5
MIN_AGREEMENT = 0.6


def test_default_model_int8_close_to_float32(default_model_path):
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
    results = {}
    for quantization in ("none", "int8"):
        llm = LLM(str(default_model_path), device="cpu", dtype="float32", cpu_precision="float32",
                  quantization=quantization, max_model_len=512, kv_cache_dtype="float32")
        ids = [llm.get_tokenizer()(p, add_special_tokens=False).input_ids for p in PROMPTS]
        model = llm.llm_engine.worker.model
        linears = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
        if quantization == "int8":
            assert all(isinstance(m.kernel, Int8Linear) for m in linears)
            assert isinstance(model.lm_head_kernel, Int8Linear)
            # 1 byte per parameter + a float32 scale per channel (SmolLM2's K need no padding)
            kernels = [m.kernel for m in linears] + [model.lm_head_kernel]
            assert sum(k.nbytes() for k in kernels) == sum(k.out_features * (k.in_features + 4) for k in kernels)
        texts = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": i} for i in ids], params,
                                                                use_tqdm=False)]
        logits = torch.stack([first_step_logits(llm, i) for i in ids])
        results[quantization] = (texts, logits)
        llm.shutdown()
    (ref_texts, ref_logits), (texts, logits) = results["none"], results["int8"]
    diff = float((logits - ref_logits).abs().max())
    same_top1 = int((logits.argmax(-1) == ref_logits.argmax(-1)).sum())
    prefix = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), len(r)) for t, r in zip(texts, ref_texts)]
    agreement = sum(prefix) / sum(len(r) for r in ref_texts)
    print(f"\nint8 vs float32, default model: max |logit diff| {diff:.3f} (logit range "
          f"{float(ref_logits.min()):.1f}..{float(ref_logits.max()):.1f}), first-token argmax equal "
          f"{same_top1}/{len(PROMPTS)}, greedy tokens before first difference {sum(prefix)}/"
          f"{sum(len(r) for r in ref_texts)} ({agreement:.0%}), prompts fully equal "
          f"{sum(p == 16 for p in prefix)}/{len(PROMPTS)}")
    assert diff <= LOGIT_TOLERANCE
    assert same_top1 >= len(PROMPTS) - 1
    assert agreement >= MIN_AGREEMENT

