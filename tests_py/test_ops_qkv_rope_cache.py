"""pagedserve.ops.qkv_rope_cache (the attention's input in one pass: cuda/qkv_rope_cache.cu and its CPU
reference) against the unfused ops it replaces on the same device, bit for bit: rotary_embedding on the q / k
column slices, then reshape_and_cache; full and partial rotary, GQA and MHA, a padded token (no KV write);
on a GPU also against the CPU op; bad arguments are clear errors."""

from __future__ import annotations

import pytest
import torch
from ops_testing import DEVICES, DTYPES, gen, randn  # noqa: F401  (fixtures)

from pagedserve import ops

SHAPES = [(5, 8, 2, 128, 128, 16), (3, 4, 4, 64, 32, 16), (4, 6, 2, 80, 40, 32), (2, 3, 1, 16, 8, 16)]


def problem(tokens, hq, hkv, d, r, block, dtype, gen):
    qkv = randn(tokens, (hq + 2 * hkv) * d, gen=gen, dtype=dtype)
    cos_sin = ops.rope_cos_sin_cache(64, r, 10000.0)
    positions = torch.randint(0, 64, (tokens,), generator=gen, dtype=torch.int32)
    slots = torch.arange(tokens, dtype=torch.int32) * 3 + 1
    slots[1] = -1  # a padded token: no KV write
    cache = randn(2, 4, hkv, block, d, gen=gen, dtype=dtype)
    return qkv, cos_sin, positions, slots, cache


def fused(qkv, cos_sin, positions, slots, cache, hq, device):
    qkv, cos_sin, positions, slots, cache = (t.to(device) for t in (qkv, cos_sin, positions, slots, cache.clone()))
    d = cache.shape[-1]
    query = torch.full((qkv.shape[0], hq, d), float("nan"), dtype=qkv.dtype, device=device)
    ops.qkv_rope_cache(query, qkv, positions, cos_sin, cache[0], cache[1], slots)
    return query.cpu(), cache.cpu()


def unfused(qkv, cos_sin, positions, slots, cache, hq, device):
    qkv, cos_sin, positions, slots, cache = (t.to(device) for t in (qkv, cos_sin, positions, slots, cache.clone()))
    d, hkv = cache.shape[-1], cache.shape[2]
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    query, key, value = (x.contiguous().view(qkv.shape[0], -1, d) for x in (q, k, v))
    ops.rotary_embedding(positions, query, key, cos_sin)
    ops.reshape_and_cache(key, value, cache[0], cache[1], slots)
    return query.cpu(), cache.cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-Hq{}-Hkv{}-D{}-R{}-B{}".format(*s))
def test_same_bits_as_rope_then_cache_write(device, dtype, shape, gen):
    args = problem(*shape, dtype, gen)
    hq = shape[1]
    query, cache = fused(*args, hq, device)
    query_ref, cache_ref = unfused(*args, hq, device)
    assert torch.equal(query, query_ref)
    assert torch.equal(cache, cache_ref)
    assert torch.equal(cache[:, :, :, 0, :], args[4][:, :, :, 0, :])  # slot 0 belongs to no token: untouched


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_the_cpu_op(dtype, gen):
    args = problem(*SHAPES[0], dtype, gen)
    query, cache = fused(*args, SHAPES[0][1], "cuda")
    query_cpu, cache_cpu = fused(*args, SHAPES[0][1], "cpu")
    torch.testing.assert_close(query.float(), query_cpu.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(cache.float(), cache_cpu.float(), rtol=1e-2, atol=1e-2)


def test_rejects_mismatched_shapes(gen):
    qkv, cos_sin, positions, slots, cache = problem(*SHAPES[0], torch.float32, gen)
    query = torch.empty(qkv.shape[0], 7, 128)  # 7 q heads do not fit qkv's columns
    with pytest.raises(ValueError, match="qkv_rope_cache: qkv"):
        ops.qkv_rope_cache(query, qkv, positions, cos_sin, cache[0], cache[1], slots)
    bad = positions.clone()
    bad[0] = 64
    with pytest.raises(ValueError, match="qkv_rope_cache: positions\\[0\\] = 64 is outside"):
        ops.qkv_rope_cache(torch.empty(qkv.shape[0], 8, 128), qkv, bad, cos_sin, cache[0], cache[1], slots)
