"""pagedserve.ops.small_batch_linear (a decode step's products: 1..8 rows, cuda/small_batch_linear.cu and its
CPU reference) against float64 torch: every row count, K not a multiple of a warp's 256-element stride, bias,
the gated silu(gate) * up epilogue; on a GPU also the kernel against the CPU op and a row's result the same in
any batch (the summation order depends on K only)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ops_testing import DEVICES, DTYPES, TOL, gen, randn  # noqa: F401  (fixtures)

from pagedserve import ops


def reference(x, weight, bias, gated, dtype):
    """float64 products; gated: gate and up rounded to the dtype, silu rounded, as the unfused layers store them."""
    y = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    if not gated:
        return y
    gate, up = y.chunk(2, dim=-1)
    gate, up = gate.to(dtype).double(), up.to(dtype).double()
    return F.silu(gate).to(dtype).double() * up


def run(x, weight, bias, gated, device):
    x, weight = x.to(device), weight.to(device)
    bias = None if bias is None else bias.to(device)
    out = torch.full((x.shape[0], weight.shape[0] // (2 if gated else 1)), float("nan"), dtype=x.dtype, device=device)
    ops.small_batch_linear(out, x, weight, bias, gated)
    return out.cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("k, n, bias, gated", [(264, 40, False, False), (2048, 24, True, False),
                                                (520, 36, True, True), (64, 10, False, True),
                                                # long rows: 2, 3 and 9 rounds of eight loads per lane in 16 bits
                                                (2312, 12, True, True), (5632, 20, False, False),
                                                (16400, 6, False, True)])
def test_matches_float64(device, dtype, rows, k, n, bias, gated, gen):
    x = randn(rows, k, gen=gen, dtype=dtype)
    weight = randn(n, k, gen=gen, dtype=dtype, scale=k ** -0.5)
    b = randn(n, gen=gen, dtype=dtype) if bias else None
    out = run(x, weight, b, gated, device)
    torch.testing.assert_close(out.double(), reference(x, weight, b, gated, dtype), **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [2048, 5632])  # one round of loads per lane; three
def test_cuda_rows_do_not_depend_on_the_batch(dtype, k, gen):
    """Row 0 alone and in batches of 2..8 of other rows: the same bits (decode steps are batch-invariant here)."""
    x = randn(8, k, gen=gen, dtype=dtype)
    weight = randn(512, k, gen=gen, dtype=dtype, scale=0.02)
    alone = run(x[:1], weight, None, False, "cuda")
    for rows in range(2, 9):
        assert torch.equal(run(x[:rows], weight, None, False, "cuda")[:1], alone)
    cpu = run(x, weight, None, False, "cpu")
    torch.testing.assert_close(run(x, weight, None, False, "cuda").double(), cpu.double(), **TOL[dtype])


def test_rejects_what_it_cannot_serve(gen):
    x9 = randn(9, 64, gen=gen)
    weight = randn(16, 64, gen=gen)
    with pytest.raises(ValueError, match="small_batch_linear: x must have 1..8 rows"):
        ops.small_batch_linear(torch.empty(9, 16), x9, weight)
    with pytest.raises(ValueError, match="small_batch_linear"):
        ops.small_batch_linear(torch.empty(2, 16), randn(2, 64, gen=gen), randn(15, 64, gen=gen), gated=True)
