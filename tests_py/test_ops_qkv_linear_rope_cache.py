"""pagedserve.ops.qkv_linear_rope_cache (a decode step's qkv projection, rope and KV-cache write in one kernel:
cuda/qkv_linear_rope_cache.cu and its CPU reference): bit for bit the unfused small_batch_linear then
qkv_rope_cache on the same device, and within the dtype's tolerance of a float64 product roped as transformers
ropes (cos, sin and each product in the model dtype); 1..4 rows, full and partial rotary, GQA and MHA, bias, a
padded token (no KV write), a position outside the table (left unrotated, as qkv_rope_cache leaves it); bad
arguments are clear errors."""

from __future__ import annotations

import pytest
import torch
from ops_testing import DEVICES, DTYPES, TOL, gen, randn  # noqa: F401  (fixtures)

from pagedserve import ops

# rows, Hq, Hkv, D, R, block size, K, bias
# The CUDA kernel takes rotation pairs 4 to a block: 18 pairs (the fifth shape) leave the last block part full.
SHAPES = [(1, 4, 2, 64, 64, 16, 264, False), (2, 6, 2, 80, 40, 16, 520, True), (4, 3, 1, 16, 8, 16, 64, True),
          (3, 4, 4, 128, 128, 32, 2048, False), (2, 5, 1, 12, 6, 16, 72, True)]
MAX_POSITION = 64


def problem(rows, hq, hkv, d, r, block, k, bias, dtype, gen):
    width = (hq + 2 * hkv) * d
    x = randn(rows, k, gen=gen, dtype=dtype)
    weight = randn(width, k, gen=gen, dtype=dtype, scale=k ** -0.5)
    b = randn(width, gen=gen, dtype=dtype) if bias else None
    cos_sin = ops.rope_cos_sin_cache(MAX_POSITION, r, 10000.0)
    positions = torch.randint(0, MAX_POSITION, (rows,), generator=gen, dtype=torch.int32)
    slots = torch.arange(rows, dtype=torch.int32) * 3 + 1
    if rows > 1:
        slots[1] = -1  # a padded token: no KV write
    cache = randn(2, 4, hkv, block, d, gen=gen, dtype=dtype)
    return x, weight, b, cos_sin, positions, slots, cache


def run(args, hq, device, fused=True):
    x, weight, b, cos_sin, positions, slots, cache = (None if t is None else t.to(device) for t in args)
    cache = cache.clone()
    query = torch.full((x.shape[0], hq, cache.shape[-1]), float("nan"), dtype=x.dtype, device=device)
    if fused:
        ops.qkv_linear_rope_cache(query, x, weight, b, positions, cos_sin, cache[0], cache[1], slots)
    else:
        qkv = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=device)
        ops.small_batch_linear(qkv, x, weight, b)
        ops.qkv_rope_cache(query, qkv, positions, cos_sin, cache[0], cache[1], slots)
    return query.cpu(), cache.cpu()


def transformers_style(args, hq):
    """float64 product rounded to the dtype, then HF's rotate_half rope in the dtype, then the cache writes."""
    x, weight, b, cos_sin, positions, slots, cache = args
    dtype, cache = x.dtype, cache.clone()
    hkv, d, r = cache.shape[2], cache.shape[-1], cos_sin.shape[1]
    qkv = (x.double() @ weight.double().T + (0 if b is None else b.double())).to(dtype)
    q, k, v = (t.reshape(x.shape[0], -1, d) for t in qkv.split((hq * d, hkv * d, hkv * d), dim=-1))
    cos, sin = cos_sin[positions.long()].chunk(2, dim=-1)
    cos = torch.cat([cos, cos], dim=-1).to(dtype)[:, None, :]
    sin = torch.cat([sin, sin], dim=-1).to(dtype)[:, None, :]

    def rope(t):
        rot, rest = t[..., :r], t[..., r:]
        x1, x2 = rot.chunk(2, dim=-1)
        return torch.cat([rot * cos + torch.cat([-x2, x1], dim=-1) * sin, rest], dim=-1)

    q, k = rope(q), rope(k)
    block = cache.shape[3]
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            cache[0, slot // block, :, slot % block] = k[token]
            cache[1, slot // block, :, slot % block] = v[token]
    return q, cache


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M{}-Hq{}-Hkv{}-D{}-R{}-B{}-K{}-bias{}".format(*s))
def test_same_bits_as_the_product_then_rope_and_cache_write(device, dtype, shape, gen):
    args = problem(*shape, dtype, gen)
    query, cache = run(args, shape[1], device)
    query_ref, cache_ref = run(args, shape[1], device, fused=False)
    assert torch.equal(query, query_ref)
    assert torch.equal(cache, cache_ref)
    assert torch.equal(cache[:, :, :, 0, :], args[6][:, :, :, 0, :])  # slot 0 belongs to no token: untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "M{}-Hq{}-Hkv{}-D{}-R{}".format(*s[:5]))
def test_close_to_a_transformers_style_rope(device, dtype, shape, gen):
    args = problem(*shape, dtype, gen)
    query, cache = run(args, shape[1], device)
    query_ref, cache_ref = transformers_style(args, shape[1])
    torch.testing.assert_close(query.double(), query_ref.double(), **TOL[dtype])
    torch.testing.assert_close(cache.double(), cache_ref.double(), **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_position_outside_the_table_stays_unrotated(dtype, gen):
    args = list(problem(*SHAPES[1], dtype, gen))
    args[4] = args[4].clone()
    args[4][0] = MAX_POSITION  # past the table: the CUDA kernels leave q and k as they are
    query, cache = run(args, SHAPES[1][1], "cuda")
    query_ref, cache_ref = run(args, SHAPES[1][1], "cuda", fused=False)
    assert torch.equal(query, query_ref) and torch.equal(cache, cache_ref)
    x, weight, b = args[0], args[1], args[2]
    plain = (x[:1].double() @ weight.double().T + b.double()).to(dtype)
    torch.testing.assert_close(query[0].reshape(-1).double(), plain[0, :query[0].numel()].double(), **TOL[dtype])


def test_rejects_what_it_cannot_serve(gen):
    x, weight, b, cos_sin, positions, slots, cache = problem(*SHAPES[2], torch.float32, gen)
    query = torch.empty(4, 3, 16)
    with pytest.raises(ValueError, match="qkv_linear_rope_cache: x must have 1..4 rows"):
        ops.qkv_linear_rope_cache(torch.empty(5, 3, 16), torch.cat([x, x[:1]]), weight, b,
                                  torch.zeros(5, dtype=torch.int32), cos_sin, cache[0], cache[1],
                                  torch.zeros(5, dtype=torch.int32))
    with pytest.raises(ValueError, match="qkv_linear_rope_cache: weight"):
        ops.qkv_linear_rope_cache(query, x, weight[:-16], None, positions, cos_sin, cache[0], cache[1], slots)
    bad = slots.clone()
    bad[0] = 10 ** 6
    with pytest.raises(ValueError, match="qkv_linear_rope_cache: slot_mapping\\[0\\]"):
        ops.qkv_linear_rope_cache(query, x, weight, b, positions, cos_sin, cache[0], cache[1], bad)
