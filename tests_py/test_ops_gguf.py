"""The GGUF block kernels (cpp/ops/gguf_linear.cc) against the `gguf` package.

Oracle: gguf.quants.dequantize of the same blocks, then a float64 matrix product.
Blocks come from gguf.quants.quantize where the package can make them (Q8_0, Q4_0,
Q4_1); for the K-quants, which it only decodes, from random bytes with finite,
small float16 scales. The kernels compute in float32, so the bound is float32
rounding of a K-term sum: |y - y64| <= 2e-6 * K^0.5 * (|x| @ |W|^T) + 1e-6.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, quants
from ops_testing import cpu_isa, torch_single_thread  # noqa: F401  (fixtures)

from pagedserve import ops

QUANTIZABLE = [T.Q8_0, T.Q4_0, T.Q4_1]
K_QUANTS = [T.Q4_K, T.Q5_K, T.Q6_K]
ALL_TYPES = QUANTIZABLE + K_QUANTS
# Byte offsets of each K-quant block's float16 scales (gguf_blocks.h): d (and dmin).
_HALF_OFFSETS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def make_blocks(qtype: T, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, row_bytes] uint8 blocks of type qtype for an [n, k] matrix."""
    if qtype in QUANTIZABLE:
        return quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n, k // block_elems, block_bytes), dtype=np.uint8)
    for offset in _HALF_OFFSETS[qtype]:
        scales = rng.uniform(-0.02, 0.02, size=(n, k // block_elems)).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scales[..., None].view(np.uint8)
    return blocks.reshape(n, -1)


def dequantized(blocks: np.ndarray, qtype: T) -> np.ndarray:
    return quants.dequantize(blocks, qtype).astype(np.float64)


def assert_matches_float64(y: torch.Tensor, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None):
    ref = x.astype(np.float64) @ w.T + (0 if bias is None else bias.astype(np.float64))
    bound = 2e-6 * np.sqrt(x.shape[1]) * (np.abs(x) @ np.abs(w).T) + 1e-6
    err = np.abs(y.numpy().astype(np.float64) - ref)
    assert (err <= bound).all(), f"max error {err.max():.3g}, worst excess {(err - bound).max():.3g}"


def run(x: np.ndarray, blocks: np.ndarray, qtype: T, bias: np.ndarray | None = None) -> torch.Tensor:
    out = torch.full((x.shape[0], blocks.shape[0]), float("nan"))
    ops.gguf_linear(out, torch.from_numpy(x), torch.from_numpy(blocks), int(qtype),
                    None if bias is None else torch.from_numpy(bias))
    return out


def _k_sizes(qtype: T) -> list[int]:
    return [256, 512] if qtype in K_QUANTS else [32, 96, 576]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 17, 130])
def test_gguf_linear_matches_dequantized_float64(qtype, m, cpu_isa):
    rng = np.random.default_rng(int(qtype) * 1000 + m)
    for n in (1, 5, 67):
        for k in _k_sizes(qtype):
            blocks = make_blocks(qtype, n, k, rng)
            x = rng.standard_normal((m, k)).astype(np.float32)
            assert_matches_float64(run(x, blocks, qtype), x, dequantized(blocks, qtype))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_gguf_linear_bias_and_column_slice_of_output(qtype, cpu_isa):
    rng = np.random.default_rng(7)
    k = _k_sizes(qtype)[0]
    blocks = make_blocks(qtype, 9, k, rng)
    x = rng.standard_normal((5, k)).astype(np.float32)
    bias = rng.standard_normal(9).astype(np.float32)
    wide = torch.full((5, 20), -7.0)
    ops.gguf_linear(wide[:, 4:13], torch.from_numpy(x), torch.from_numpy(blocks), int(qtype), torch.from_numpy(bias))
    assert_matches_float64(wide[:, 4:13].contiguous(), x, dequantized(blocks, qtype), bias)
    assert (wide[:, :4] == -7).all() and (wide[:, 13:] == -7).all()


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_gguf_linear_one_and_two_threads_bit_identical(qtype):
    rng = np.random.default_rng(11)
    k = 512 if qtype in K_QUANTS else 576
    blocks = make_blocks(qtype, 301, k, rng)
    x = rng.standard_normal((70, k)).astype(np.float32)
    before = ops.num_threads()
    try:
        results = []
        for threads in (1, 2):
            ops.set_num_threads(threads)
            results.append(run(x, blocks, qtype))
    finally:
        ops.set_num_threads(before)
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_gguf_dequantize_rows_matches_package(qtype, id_dtype, cpu_isa):
    rng = np.random.default_rng(3)
    k = _k_sizes(qtype)[-1]
    blocks = make_blocks(qtype, 40, k, rng)
    ids = torch.tensor([39, 0, 7, 7, 21], dtype=id_dtype)
    out = torch.empty(len(ids), k)
    ops.gguf_dequantize_rows(out, torch.from_numpy(blocks), int(qtype), ids)
    expected = quants.dequantize(blocks, qtype)[ids.numpy()]
    np.testing.assert_array_equal(out.numpy(), expected)


def test_unsupported_type_names_the_supported_ones():
    x = torch.zeros(1, 256)
    with pytest.raises(ValueError, match=r"GGUF tensor type 10 is not supported; supported: Q4_0 \(2\).*Q6_K \(14\)"):
        ops.gguf_linear(torch.empty(1, 2), x, torch.zeros(2, 84, dtype=torch.uint8), int(T.Q2_K))


def test_row_bytes_must_match_k():
    with pytest.raises(ValueError, match=r"gguf_linear: blocks has 20 bytes per row; Q4_1 rows of K = 64 take 40"):
        ops.gguf_linear(torch.empty(1, 2), torch.zeros(1, 64), torch.zeros(2, 20, dtype=torch.uint8), int(T.Q4_1))
    with pytest.raises(ValueError, match=r"K = 48 is not a multiple of Q4_0's 32-weight blocks"):
        ops.gguf_linear(torch.empty(1, 2), torch.zeros(1, 48), torch.zeros(2, 18, dtype=torch.uint8), int(T.Q4_0))


def test_dequantize_rows_rejects_ids_out_of_range():
    blocks = torch.zeros(3, 18, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"ids\[1\] = 3 is outside \[0, 3\)"):
        ops.gguf_dequantize_rows(torch.empty(2, 32), blocks, int(T.Q4_0), torch.tensor([0, 3], dtype=torch.int32))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_one_row_equals_that_row_of_a_batch(qtype, cpu_isa):
    """A decode step (M = 1) may take a path of its own (blocks decoded in registers); its sums run in the
    same order, so a row's result does not depend on how many rows came with it."""
    rng = np.random.default_rng(5)
    k = _k_sizes(qtype)[-1]
    blocks = make_blocks(qtype, 13, k, rng)
    x = rng.standard_normal((3, k)).astype(np.float32)
    assert torch.equal(run(x[1:2], blocks, qtype)[0], run(x, blocks, qtype)[1])
