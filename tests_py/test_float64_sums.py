"""Float64 sums of the row-parallel products and position-free CPU activations (layers.Linear's float64_sums,
activations.position_free): what makes TP = N give TP = 1's float32 numbers, checked without processes by cutting
one product's input in two as the ranks do (tests_py/test_tensor_parallel.py runs the ranks).

  op          ops.packed_linear_float64_sums on every ISA: float64 out = the float64 product of the bf16
              weights (to 1e-12), float32 out = those sums rounded, plus the bias in float32;
  linear      a Linear with float64_sums (torch's product, and bf16 tiles) equals its two column halves'
              float64 sums added and rounded, bit for bit; with float32 sums the halves differ;
  activation  the GeGLU / gelu_new of a row equals that of its halves computed apart.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve import _core, ops
from pagedserve.models.activations import GeluAndMul, activation
from pagedserve.models.layers import Linear
from pagedserve.models.linear_kernels import PackedBf16

ROWS, OUT, IN, SPLIT = 37, 576, 1536, 768  # SmolLM2's down projection, cut as at TP = 2


def bf16_values(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16).float()


@pytest.mark.parametrize("rows,out_features,in_features", [(1, 16, 32), (5, 33, 7), (13, 100, 65), (0, 16, 32)])
def test_op_sums_in_float64(cpu_isa, rows, out_features, in_features):
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    weight, bias = bf16_values(out_features, in_features, seed=1, scale=0.1), torch.randn(out_features)
    packed = ops.pack_linear_weight(weight)
    sums = torch.full((rows, out_features), float("nan"), dtype=torch.float64)
    ops.packed_linear_float64_sums(sums, x, packed)
    torch.testing.assert_close(sums, F.linear(x.double(), weight.double()), rtol=1e-12, atol=1e-12)
    rounded = torch.full((rows, out_features), float("nan"))
    ops.packed_linear_float64_sums(rounded, x, packed, bias)
    assert torch.equal(rounded, sums.float() + bias)


# Up to two row blocks per tile (weights widened at each use on AVX2), three or more (widened once per tile),
# rows past the 128-row chunk (x widened once per chunk).
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 40, 576), (4, 33, 7), (7, 16, 65), (131, 20, 33)])
def test_op_gives_the_same_bits_on_every_isa(cpu_isa, rows, out_features, in_features):
    """Each kernel forms the even and odd chains of every column in K order (exact products), whatever its row
    blocks and column halves: the float64 sums equal the portable loops' at the baseline level bit for bit."""
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(in_features))
    packed = ops.pack_linear_weight(bf16_values(out_features, in_features, seed=3, scale=0.1))
    sums = torch.empty(rows, out_features, dtype=torch.float64)
    ops.packed_linear_float64_sums(sums, x, packed)
    before = ops.cpu_isa()
    _core.ops.set_cpu_isa("baseline")
    try:
        baseline = torch.empty_like(sums)
        ops.packed_linear_float64_sums(baseline, x, packed)
    finally:
        _core.ops.set_cpu_isa(before)
    assert torch.equal(sums, baseline)


def test_op_rejects_a_bias_with_float64_sums():
    x, weight = torch.randn(2, 32), bf16_values(16, 32, seed=2)
    with pytest.raises(ValueError, match="packed_linear_float64_sums: bias"):
        ops.packed_linear_float64_sums(torch.empty(2, 16, dtype=torch.float64), x, ops.pack_linear_weight(weight),
                                       torch.zeros(16))


def halves(weight: torch.Tensor, float64_sums: bool, packed: bool) -> tuple[Linear, Linear, Linear]:
    """The whole product and its two column halves, as TP = 1 and the two ranks of TP = 2 hold them."""
    def linear(w: torch.Tensor) -> Linear:
        layer = Linear(w.shape[1], (w.shape[0],), False, torch.float32, torch.device("cpu"), float64_sums)
        layer.weight.data.copy_(w)
        if packed:
            layer.use_kernel(PackedBf16(layer.weight))
        return layer
    return linear(weight), linear(weight[:, :SPLIT].contiguous()), linear(weight[:, SPLIT:].contiguous())


@pytest.mark.parametrize("packed", [False, True], ids=["torch", "bf16_tiles"])
def test_linear_halves_round_as_the_whole(packed):
    x = torch.randn(ROWS, IN, generator=torch.Generator().manual_seed(3))
    x0, x1 = x[:, :SPLIT].contiguous(), x[:, SPLIT:].contiguous()
    weight = bf16_values(OUT, IN, seed=4, scale=0.05)
    whole, first, second = halves(weight, True, packed)
    assert torch.equal(whole(x), (first.sums_in_float64(x0) + second.sums_in_float64(x1)).float())
    whole, first, second = halves(weight, False, packed)  # float32 sums: most outputs differ in the last bits
    differs = (whole(x) != first(x0) + second(x1)).float().mean().item()
    assert differs > 0.1, differs


@pytest.mark.parametrize("act", [GeluAndMul("tanh"), GeluAndMul("none"), activation("gelu_new")],
                         ids=["geglu_tanh", "geglu", "gelu_new"])
def test_activation_of_a_row_equals_its_halves(act):
    x = torch.randn(ROWS, 2 * 40, generator=torch.Generator().manual_seed(5)) * 3
    if isinstance(act, GeluAndMul):  # [gate | up]: each rank holds half of the gate and of the up columns
        gate, up = x[:, :40], x[:, 40:]
        parts = [act(torch.cat([gate[:, :20], up[:, :20]], dim=1)), act(torch.cat([gate[:, 20:], up[:, 20:]], dim=1))]
    else:
        parts = [act(x[:, :40]), act(x[:, 40:])]
    assert torch.equal(act(x), torch.cat(parts, dim=1))
