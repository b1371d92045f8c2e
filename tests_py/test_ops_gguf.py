"""The GGUF block kernels (cpp/ops/gguf_linear.cc) against the `gguf` package.

Oracle: gguf.quants.dequantize of the same blocks, then a float64 matrix product.
Blocks come from gguf.quants.quantize where the package can make them (Q8_0, Q4_0,
Q4_1); for the K-quants, which it only decodes, from random bytes with finite,
small float16 scales. The float32 kernels' bound is float32 rounding of a K-term
sum: |y - y64| <= 2e-6 * K^0.5 * (|x| @ |W|^T) + 1e-6.

At the AVX2 level and above, every format takes the int8-activation path
(cpp/ops/gguf_int8.h; vpdpbusd with AVX512_VNNI, AVX2's products elsewhere, the same
bits): x is rounded to int8 per 32-element block first. Those
results are checked twice: tightly (1e-5 of the summed magnitudes) against a float64
oracle of the same arithmetic (x_q, d_x from int8_activations() below, the blocks' integer
codes and scales), and against the dequantized float64 product with the bound that
rounding x implies: each element moves by at most d_x / 2 = max|x_block| / 254.

Interleaved blocks (cpp/ops/gguf_interleaved.h; Q4_0, Q4_1, Q8_0, eight rows side by side, as loading makes
them at AVX2 and above): the rearrangement loses no byte and row lookups decode as before; the product equals,
bit for bit, its float32 steps written in numpy below (one exact integer dot per row and block), at every ISA
level with such kernels (so AVX2's and VNNI's bits are the same), for one row alone as in a batch, on one
thread as on two; below AVX2 the rows go back to the file's layout for the float32 kernels.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, quants
from ops_testing import cpu_isa, torch_single_thread  # noqa: F401  (fixtures)

from pagedserve import _core, ops
from pagedserve.testing.gguf_blocks import QUANTIZABLE as QUANTIZABLE_NAMES, random_blocks

QUANTIZABLE = [T[name] for name in QUANTIZABLE_NAMES]  # the formats gguf.quants makes
K_QUANTS = [T.Q4_K, T.Q5_K, T.Q6_K]
ALL_TYPES = QUANTIZABLE + K_QUANTS
INT8_TYPES = ALL_TYPES  # the formats with an int8-activation kernel


def make_blocks(qtype: T, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, row_bytes] uint8 blocks of type qtype for an [n, k] matrix (K-quant scales in +-0.02)."""
    return random_blocks(qtype.name, n, k, rng)


def dequantized(blocks: np.ndarray, qtype: T) -> np.ndarray:
    return quants.dequantize(blocks, qtype).astype(np.float64)


def assert_matches_float64(y: torch.Tensor, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None):
    ref = x.astype(np.float64) @ w.T + (0 if bias is None else bias.astype(np.float64))
    bound = 2e-6 * np.sqrt(x.shape[1]) * (np.abs(x) @ np.abs(w).T) + 1e-6
    err = np.abs(y.numpy().astype(np.float64) - ref)
    assert (err <= bound).all(), f"max error {err.max():.3g}, worst excess {(err - bound).max():.3g}"


def int8_path(qtype: T) -> bool:
    """Whether gguf_linear takes the int8-activation path for qtype at the current ISA level: AVX2 and above
    (vpdpbusd where the level is AVX-512 and the CPU has VNNI, AVX2's products elsewhere)."""
    return qtype in INT8_TYPES and ops.cpu_isa() != "baseline"


def int8_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] float32 quantized as the kernel does: (x_q [M, K/32, 32] int64, d_x [M, K/32] float32).
    d = max|x| / 127 per block; x_q = x * (1 / d) rounded to nearest, ties to even; all in float32."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = (np.abs(blocks).max(-1) / np.float32(127)).astype(np.float32)
    inverse = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    return np.rint(blocks * inverse[..., None]).astype(np.int64), d


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, min) pairs of Q4_K / Q5_K super-blocks from their 12 scale bytes [..., 12]."""
    s = scales.astype(np.int64)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def _half(b: np.ndarray, offset: int) -> np.ndarray:
    return b[..., offset:offset + 2].copy().view(np.float16)[..., 0].astype(np.float64)


def _k_block_codes(b: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """block_codes() of K-quant super-blocks b [N, S, bytes], each cut into 8 blocks of 32 weights."""
    n, s = b.shape[:2]
    if qtype == T.Q6_K:  # element 128 h + r: ql[64 h + r % 64] >> 4 (r // 64), qh[32 h + r % 32] >> 2 (r // 32)
        ql, qh = b[..., :128].astype(np.int64), b[..., 128:192].astype(np.int64)
        codes = np.empty((n, s, 256), dtype=np.int64)
        for h in range(2):
            for r in range(128):
                low = (ql[..., 64 * h + r % 64] >> (4 * (r // 64))) & 15
                codes[..., 128 * h + r] = low | (((qh[..., 32 * h + r % 32] >> (2 * (r // 32))) & 3) << 4)
        scales = b[..., 192:208].copy().view(np.int8).astype(np.float64) * _half(b, 208)[..., None]  # [N, S, 16]
        dw = np.repeat(scales, 16, axis=-1)  # per element
        return (codes - 32).reshape(n, 8 * s, 32), dw.reshape(n, 8 * s, 32), np.zeros((n, 8 * s))
    sc, mn = _k_scale_min(b[..., 4:16])  # [N, S, 8]
    start = 16 if qtype == T.Q4_K else 48
    nib = b[..., start:start + 128].astype(np.int64).reshape(n, s, 4, 32)
    codes = np.stack([nib & 15, nib >> 4], axis=3).reshape(n, s, 8, 32)  # sub-block 2g low, 2g + 1 high
    if qtype == T.Q5_K:  # bit j of qh[i] is the 5th bit of element i of sub-block j
        qh = b[..., 16:48].astype(np.int64)
        codes = codes | (((qh[:, :, None, :] >> np.arange(8)[None, None, :, None]) & 1) << 4)
    dw = _half(b, 0)[..., None] * sc
    mw = -_half(b, 2)[..., None] * mn
    return codes.reshape(n, 8 * s, 32), np.repeat(dw.reshape(n, 8 * s, 1), 32, axis=-1), mw.reshape(n, 8 * s)


def block_codes(blocks: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [N, K/32, 32] int64, scale d_w [N, K/32, 32] per weight, offset m_w [N, K/32]) with
    w = d_w codes + m_w, per 32-weight block (a K-quant super-block's 8 sub-blocks; Q6_K's scale
    changes every 16 weights)."""
    n = blocks.shape[0]
    size = GGML_QUANT_SIZES[qtype][1]
    b = blocks.reshape(n, -1, size)
    if qtype in K_QUANTS:
        return _k_block_codes(b, qtype)
    d = _half(b, 0)
    dw = np.repeat(d[..., None], 32, axis=-1)
    if qtype == T.Q8_0:
        return b[:, :, 2:].copy().view(np.int8).astype(np.int64), dw, np.zeros_like(d)
    start = 2 if qtype == T.Q4_0 else 4
    nib = b[:, :, start:start + 16].astype(np.int64)
    codes = np.concatenate([nib & 15, nib >> 4], axis=-1)
    if qtype == T.Q4_0:
        return codes - 8, dw, np.zeros_like(d)
    return codes, dw, _half(b, 2)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_block_codes_oracle_equals_package_dequantization(qtype):
    """The int8 oracle's own decoding (codes, scales, offsets per 32-weight block) against the `gguf` package."""
    rng = np.random.default_rng(23)
    k = 512 if qtype in K_QUANTS else 96
    blocks = make_blocks(qtype, 6, k, rng)
    codes, dw, mw = block_codes(blocks, qtype)
    np.testing.assert_array_equal((codes * dw + mw[..., None]).reshape(6, k), dequantized(blocks, qtype))


def assert_matches_int8_arithmetic(y: torch.Tensor, x: np.ndarray, blocks: np.ndarray, qtype: T,
                                   bias: np.ndarray | None = None):
    xq, dx = int8_activations(x)
    codes, dw, mw = block_codes(blocks, qtype)
    dots = np.einsum("mbk,nbk->mnb", xq.astype(np.float64), codes * dw)  # exact: d_w codes x_q fit 53 bits
    sums = xq.sum(-1).astype(np.float64)  # [M, B]
    dx64 = dx.astype(np.float64)
    terms = dx64[:, None, :] * (dots + mw[None] * sums[:, None, :])
    ref = terms.sum(-1) + (0 if bias is None else bias.astype(np.float64))
    bound = 1e-5 * np.abs(terms).sum(-1) + 1e-6
    err = np.abs(y.numpy().astype(np.float64) - ref)
    assert (err <= bound).all(), f"int8 oracle: max error {err.max():.3g}, worst excess {(err - bound).max():.3g}"


def assert_within_activation_rounding(y: torch.Tensor, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None):
    """|y - x W^T| <= sum_k |W[n, k]| d_x(k) / 2 (rounding x to d_x steps), plus float32 rounding."""
    ref = x.astype(np.float64) @ w.T + (0 if bias is None else bias.astype(np.float64))
    _, dx = int8_activations(x)
    step = np.repeat(dx.astype(np.float64), 32, axis=1)  # [M, K]
    bound = 0.5 * 1.001 * (step @ np.abs(w).T) + 2e-6 * np.sqrt(x.shape[1]) * (np.abs(x) @ np.abs(w).T) + 1e-6
    err = np.abs(y.numpy().astype(np.float64) - ref)
    assert (err <= bound).all(), f"max error {err.max():.3g}, worst excess {(err - bound).max():.3g}"


def assert_matches(y: torch.Tensor, x: np.ndarray, blocks: np.ndarray, qtype: T, bias: np.ndarray | None = None):
    """Checks y = x W^T (+ bias) against the oracle(s) of the path the kernel took."""
    if int8_path(qtype):
        assert_matches_int8_arithmetic(y, x, blocks, qtype, bias)
        assert_within_activation_rounding(y, x, dequantized(blocks, qtype), bias)
    else:
        assert_matches_float64(y, x, dequantized(blocks, qtype), bias)


def run(x: np.ndarray, blocks: np.ndarray, qtype: T, bias: np.ndarray | None = None) -> torch.Tensor:
    out = torch.full((x.shape[0], blocks.shape[0]), float("nan"))
    ops.gguf_linear(out, torch.from_numpy(x), torch.from_numpy(blocks), int(qtype),
                    None if bias is None else torch.from_numpy(bias))
    return out


def _k_sizes(qtype: T) -> list[int]:
    return [256, 768] if qtype in K_QUANTS else [32, 96, 576]  # 768: an odd count of super-blocks


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 17, 130])
def test_gguf_linear_matches_dequantized_float64(qtype, m, cpu_isa):
    rng = np.random.default_rng(int(qtype) * 1000 + m)
    for n in (1, 5, 67):
        for k in _k_sizes(qtype):
            blocks = make_blocks(qtype, n, k, rng)
            x = rng.standard_normal((m, k)).astype(np.float32)
            assert_matches(run(x, blocks, qtype), x, blocks, qtype)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_gguf_linear_bias_and_column_slice_of_output(qtype, cpu_isa):
    rng = np.random.default_rng(7)
    k = _k_sizes(qtype)[0]
    blocks = make_blocks(qtype, 9, k, rng)
    x = rng.standard_normal((5, k)).astype(np.float32)
    bias = rng.standard_normal(9).astype(np.float32)
    wide = torch.full((5, 20), -7.0)
    ops.gguf_linear(wide[:, 4:13], torch.from_numpy(x), torch.from_numpy(blocks), int(qtype), torch.from_numpy(bias))
    assert_matches(wide[:, 4:13].contiguous(), x, blocks, qtype, bias)
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
    x = rng.standard_normal((131, k)).astype(np.float32)
    batch = run(x, blocks, qtype)
    for m in (0, 1, 66, 130):  # register blocks of 4 rows and chunks of 64: first, inner, remainder
        assert torch.equal(run(x[m:m + 1], blocks, qtype)[0], batch[m])
    assert torch.equal(run(x[1:4], blocks, qtype), batch[1:4])


@pytest.mark.parametrize("qtype", INT8_TYPES, ids=lambda t: t.name)
def test_int8_path_edge_activations(qtype):
    """Zero blocks (d_x = 0), a block whose max is negative, ties and the extremes +-127 of x_q."""
    if not int8_path(qtype):
        pytest.skip("kernels run at the baseline level in this process")
    rng = np.random.default_rng(17)
    k = 256 if qtype in K_QUANTS else 128
    blocks = make_blocks(qtype, 7, k, rng)
    x = rng.standard_normal((3, k)).astype(np.float32)
    x[0, :32] = 0
    x[1, 32:64] = -np.abs(x[1, 32:64]) * 1e3
    x[2, 64:96] = np.arange(-16, 16, dtype=np.float32) * 0.5  # d = 8 / 127: steps of exact halves are rare
    x[2, 96:128] = 127.0
    y = run(x, blocks, qtype)
    assert_matches_int8_arithmetic(y, x, blocks, qtype)
    assert_within_activation_rounding(y, x, dequantized(blocks, qtype))


# ---------------------------------------------------------------------------
# Interleaved blocks (cpp/ops/gguf_interleaved.h): eight rows side by side, made once at load.

INTERLEAVED_TYPES = QUANTIZABLE + K_QUANTS  # every format


def shapes(qtype: T, shapes_32: tuple) -> tuple:
    """(n, k) test shapes, k scaled to whole 256-weight super-blocks for a K-quant."""
    scale = 8 if qtype in K_QUANTS else 1
    return tuple((n, k * scale) for n, k in shapes_32)


def interleave(blocks: np.ndarray, qtype: T) -> tuple[torch.Tensor, int]:
    made = ops.gguf_interleave(torch.from_numpy(blocks), int(qtype))
    assert made is not None, "the interleaved layout applies at the AVX2 level and above"
    return made


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fused multiply-add: a b is exact in float64 for float32 operands; the one rounding of the sum
    is float64's, then float32's (a double rounding that differs from a true fma only at ties, ~2^-29 a sum)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def interleaved_arithmetic(x: np.ndarray, blocks: np.ndarray, qtype: T, bias: np.ndarray | None = None) -> np.ndarray:
    """gguf_int8_interleaved.inc's float32 steps in numpy, per output and 32-weight block, blocks in order:
    Q4_1, Q4_K, Q5_K acc = fma(fma(dot, d_w, m_w sum x_q), d_x, acc) (K: a sub-block's d sc and -dmin m);
    Q4_0, Q8_0 acc = fma(dot, d_w d_x, acc), Q6_K the same per 16-weight quarter; dot the exact integer sum
    of codes x_q (Q4_0's codes less 8, Q6_K's less 32)."""
    xq, dx = int8_activations(x)
    codes, dw, mw = block_codes(blocks, qtype)
    if qtype == T.Q6_K:  # quarters of 16 weights, each with its own scale, by super-block, half, quarter, block
        order = np.arange(codes.shape[1] * 2).reshape(-1, 2, 4, 2).transpose(0, 1, 3, 2).reshape(-1)
        xq, codes, dw = (t.reshape(t.shape[0], -1, 16)[:, order] for t in (xq, codes, dw))
        dx = np.repeat(dx, 2, axis=1)[:, order]
    dots = np.einsum("mbk,nbk->mnb", xq, codes).astype(np.float32)  # |dot| < 2^24: exact
    d = dw[:, :, 0].astype(np.float32)  # a float16 per block
    sums = xq.sum(-1).astype(np.float32)
    acc = np.zeros((x.shape[0], blocks.shape[0]), dtype=np.float32)
    for b in range(dots.shape[2]):
        dx_b = dx[:, b][:, None]
        if qtype in (T.Q4_1, T.Q4_K, T.Q5_K):
            block = fma32(dots[:, :, b], d[None, :, b], mw[None, :, b].astype(np.float32) * sums[:, b][:, None])
            acc = fma32(block, dx_b, acc)
        else:
            acc = fma32(dots[:, :, b], d[None, :, b] * dx_b, acc)
    return acc if bias is None else acc + bias


def run_interleaved(x: np.ndarray, blocks: torch.Tensor, interleaved_type: int,
                    bias: np.ndarray | None = None) -> torch.Tensor:
    out = torch.full((x.shape[0], blocks.shape[0]), float("nan"))
    ops.gguf_linear(out, torch.from_numpy(x), blocks, interleaved_type, None if bias is None else torch.from_numpy(bias))
    return out


@pytest.mark.parametrize("qtype", INTERLEAVED_TYPES, ids=lambda t: t.name)
def test_interleave_keeps_every_byte_and_rows_look_up_as_before(qtype):
    if ops.cpu_isa() == "baseline":
        pytest.skip("no interleaved kernels below the AVX2 level")
    rng = np.random.default_rng(31)
    for n, k in shapes(qtype, ((8, 32), (24, 576), (64, 96))):
        blocks = make_blocks(qtype, n, k, rng)
        interleaved, interleaved_type = interleave(blocks, qtype)
        assert interleaved_type == int(qtype) + 256 and interleaved.shape == blocks.shape
        assert interleaved.numpy().tobytes() != blocks.tobytes()  # rearranged ...
        assert np.array_equal(np.sort(interleaved.numpy(), axis=None), np.sort(blocks, axis=None))  # ... not changed
        # Group 0, block 0: the eight rows' d first (row r at bytes 2r, 2r + 1; Q6_K's is a block's last 2).
        d_at = 208 if qtype == T.Q6_K else 0
        assert np.array_equal(interleaved.numpy()[0, :16], blocks[:8, d_at:d_at + 2].reshape(-1))
        out = torch.empty(n, k)
        ops.gguf_dequantize_rows(out, interleaved, interleaved_type, torch.arange(n - 1, -1, -1))
        np.testing.assert_array_equal(out.numpy(), quants.dequantize(blocks, qtype)[::-1])


@pytest.mark.parametrize("qtype", INTERLEAVED_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 17, 130])
def test_interleaved_linear_is_its_arithmetic_bit_for_bit(qtype, m, cpu_isa):
    """At AVX2 and AVX-512 (vpdpbusd where the CPU has VNNI) the same bits as the numpy steps; below AVX2
    the rows go back to the file's layout for the float32 kernels (the float64 oracle's bound)."""
    rng = np.random.default_rng(int(qtype) * 100 + m)
    for n, k in shapes(qtype, ((8, 32), (72, 96), (40, 576))):
        blocks = make_blocks(qtype, n, k, rng)
        before = ops.cpu_isa()
        _core.ops.set_cpu_isa(_core.ops.supported_cpu_isas()[-1])  # loading happens at the best level
        try:
            interleaved, interleaved_type = interleave(blocks, qtype)
        finally:
            _core.ops.set_cpu_isa(before)
        x = rng.standard_normal((m, k)).astype(np.float32)
        bias = rng.standard_normal(n).astype(np.float32)
        wide = torch.full((m, n + 11), -7.0)  # the product into columns 3 .. n + 3 of a wider output
        ops.gguf_linear(wide[:, 3:n + 3], torch.from_numpy(x), interleaved, interleaved_type, torch.from_numpy(bias))
        assert (wide[:, :3] == -7).all() and (wide[:, n + 3:] == -7).all()
        y = wide[:, 3:n + 3].contiguous()
        if cpu_isa == "baseline":
            assert torch.equal(y, run(x, blocks, qtype, bias))  # the float32 kernels on the same rows
            assert_matches_float64(y, x, dequantized(blocks, qtype), bias)
        else:
            np.testing.assert_array_equal(y.numpy(), interleaved_arithmetic(x, blocks, qtype, bias))
            assert_within_activation_rounding(y, x, dequantized(blocks, qtype), bias)


@pytest.mark.parametrize("qtype", INTERLEAVED_TYPES, ids=lambda t: t.name)
def test_interleaved_linear_edge_activations(qtype):
    """Zero blocks, a negative maximum, the extremes +-127 of x_q: AVX2 keeps Q4 sums in int16 for half a
    block (at most 4 x 2 x 15 x 127 = 15240; Q4_K's sub-block 8 x 2 x 15 x 127 = 30480), Q8_0 as |w| x
    sign(w) x_q; all must stay exact."""
    if ops.cpu_isa() == "baseline":
        pytest.skip("no interleaved kernels below the AVX2 level")
    rng = np.random.default_rng(41)
    k = 256 if qtype in K_QUANTS else 128
    blocks = make_blocks(qtype, 16, k, rng)
    codes = blocks.reshape(16, k // GGML_QUANT_SIZES[qtype][0], -1)
    if qtype == T.Q6_K:
        codes[:8, :, :192] = 0xFF  # every 6-bit code 63 (unsigned against x_q: 2 x 63 x 127 a pair)
        codes[:8, :, 192:208] = 0x7F  # scales 127
        codes[8:, :, 192:208] = 0x80  # scales -128
    else:
        codes[:8, :, -(128 if qtype == T.Q4_K else 16):] = 0xFF  # every nibble 15 (Q4) / every code -1 (Q8_0)
    if qtype == T.Q8_0:
        codes[8:, :, 2:] = 0x80  # -128: |w| = 128
    if qtype == T.Q4_K:
        codes[:8, :, 4:16] = 0xFF  # every 6-bit scale and min 63
    blocks = codes.reshape(16, -1)
    x = rng.standard_normal((3, k)).astype(np.float32)
    x[:, 128:] = 127.0 * np.sign(x[:, 128:])  # Q4_K: the second half's blocks all at +-127
    x[0, :32] = 0
    x[1, 32:64] = -np.abs(x[1, 32:64]) * 1e3
    x[2, 64:96] = 127.0
    x[2, 96:128] = -127.0
    y = run_interleaved(x, *interleave(blocks, qtype))
    np.testing.assert_array_equal(y.numpy(), interleaved_arithmetic(x, blocks, qtype))


@pytest.mark.parametrize("qtype", INTERLEAVED_TYPES, ids=lambda t: t.name)
def test_interleaved_one_row_one_thread_equal_a_batch_on_two(qtype):
    if ops.cpu_isa() == "baseline":
        pytest.skip("no interleaved kernels below the AVX2 level")
    rng = np.random.default_rng(43)
    k = 768 if qtype in K_QUANTS else 576
    blocks = make_blocks(qtype, 296, k, rng)
    interleaved, interleaved_type = interleave(blocks, qtype)
    x = rng.standard_normal((131, k)).astype(np.float32)
    before = ops.num_threads()
    try:
        ops.set_num_threads(2)
        batch = run_interleaved(x, interleaved, interleaved_type)
        ops.set_num_threads(1)
        for m in (0, 1, 66, 130):
            assert torch.equal(run_interleaved(x[m:m + 1], interleaved, interleaved_type)[0], batch[m])
        assert torch.equal(run_interleaved(x, interleaved, interleaved_type), batch)
    finally:
        ops.set_num_threads(before)


def test_interleave_refuses_rows_not_in_groups_of_8():
    assert ops.gguf_interleave(torch.zeros(12, 20, dtype=torch.uint8), int(T.Q4_1)) is None  # 12 rows
    blocks = torch.zeros(8, 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="gguf_interleave: out must be another tensor than blocks"):
        _core.ops.gguf_interleave(ops._dl(blocks), ops._dl(blocks), int(T.Q4_1))
    with pytest.raises(ValueError, match="gguf_linear: type 259: the interleaved layout takes rows in groups of 8, "
                                         "got 12"):
        ops.gguf_linear(torch.empty(1, 12), torch.zeros(1, 32), torch.zeros(12, 20, dtype=torch.uint8),
                        int(T.Q4_1) + 256)

    with pytest.raises(ValueError, match="GGUF tensor type -1 is not supported"):  # not read as -1 + 256
        ops.gguf_linear(torch.empty(1, 8), torch.zeros(1, 32), torch.zeros(8, 20, dtype=torch.uint8), -1)


def test_no_interleaved_layout_below_avx2():
    before = ops.cpu_isa()
    _core.ops.set_cpu_isa("baseline")
    try:
        assert ops.gguf_interleave(torch.zeros(8, 20, dtype=torch.uint8), int(T.Q4_1)) is None
    finally:
        _core.ops.set_cpu_isa(before)
