"""pagedserve.ops.qkv_rope_cache (the attention's input in one pass: cuda/qkv_rope_cache.cu and its CPU
reference) against the unfused ops it replaces on the same device, bit for bit: rotary_embedding on the q / k
column slices, then reshape_and_cache; full and partial rotary, GQA and MHA, a padded token (no KV write);
on a GPU also against the CPU op; bad arguments are clear errors. With q/k norms (Qwen3): the same against
rms_norm of the head rows first, and within the dtype's tolerance of transformers' Qwen3 modules."""

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


EPS = 1e-6


def fused(qkv, cos_sin, positions, slots, cache, hq, device, norms=()):
    qkv, cos_sin, positions, slots, cache = (t.to(device) for t in (qkv, cos_sin, positions, slots, cache.clone()))
    d = cache.shape[-1]
    query = torch.full((qkv.shape[0], hq, d), float("nan"), dtype=qkv.dtype, device=device)
    ops.qkv_rope_cache(query, qkv, positions, cos_sin, cache[0], cache[1], slots,
                       *(w.to(device) for w in norms), *((EPS,) if norms else ()))
    return query.cpu(), cache.cpu()


def unfused(qkv, cos_sin, positions, slots, cache, hq, device, norms=()):
    qkv, cos_sin, positions, slots, cache = (t.to(device) for t in (qkv, cos_sin, positions, slots, cache.clone()))
    d, hkv = cache.shape[-1], cache.shape[2]
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    query, key, value = (x.contiguous().view(qkv.shape[0], -1, d) for x in (q, k, v))
    if norms:  # as the model's unfused path: rms_norm of each head as a row of D
        for x, w in zip((query, key), norms):
            rows = x.view(-1, d)
            ops.rms_norm(rows, rows.clone(), w.to(device), EPS)
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


NORM_SHAPES = [(5, 8, 2, 128, 128, 16), (3, 4, 4, 64, 64, 16), (2, 3, 1, 16, 16, 16)]


def norm_weights(d, dtype, gen):
    return tuple((1 + 0.5 * randn(d, gen=gen)).to(dtype) for _ in range(2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda s: "T{}-Hq{}-Hkv{}-D{}".format(*s))
def test_q_k_norms_same_bits_as_norm_then_rope_then_cache_write(device, dtype, shape, gen):
    args = problem(*shape, dtype, gen)
    norms = norm_weights(shape[3], dtype, gen)
    query, cache = fused(*args, shape[1], device, norms)
    query_ref, cache_ref = unfused(*args, shape[1], device, norms)
    assert torch.equal(query, query_ref)
    assert torch.equal(cache, cache_ref)
    plain_query, _ = fused(*args, shape[1], device)
    assert not torch.equal(query, plain_query)  # the norms did something


def transformers_arithmetic(qkv, cos_sin, positions, hq, hkv, d, norms):
    """Qwen3's attention input as transformers computes it (its Qwen3RMSNorm per head, then
    apply_rotary_pos_emb in the model dtype): the rotated, normalized q and k heads, in float32."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    q, k, _ = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    heads = []
    for x, count, weight in ((q, hq, norms[0]), (k, hkv, norms[1])):
        norm = Qwen3RMSNorm(d, eps=EPS).to(qkv.dtype)
        with torch.no_grad():
            norm.weight.copy_(weight)
            heads.append(norm(x.reshape(-1, count, d)).transpose(0, 1))  # [heads, T, D]
    cos, sin = (t[positions.long()].repeat(1, 2).to(qkv.dtype) for t in cos_sin.chunk(2, dim=-1))
    query, key = apply_rotary_pos_emb(*heads, cos, sin, unsqueeze_dim=0)
    return query.transpose(0, 1).float(), key.transpose(0, 1).float()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_q_k_norms_match_transformers_arithmetic(device, dtype, gen):
    tokens, hq, hkv, d, r, block = NORM_SHAPES[0]
    qkv, cos_sin, positions, slots, cache = problem(*NORM_SHAPES[0], dtype, gen)
    norms = norm_weights(d, dtype, gen)
    query, new_cache = fused(qkv, cos_sin, positions, slots, cache, hq, device, norms)
    query_ref, key_ref = transformers_arithmetic(qkv, cos_sin, positions, hq, hkv, d, norms)
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(query.float(), query_ref, rtol=tol, atol=tol)
    for t in (0, 2):  # tokens with a KV slot (token 1 is padded)
        block_index, offset = divmod(int(slots[t]), block)
        torch.testing.assert_close(new_cache[0, block_index, :, offset].float(), key_ref[t], rtol=tol, atol=tol)


def test_q_k_norms_bad_arguments_are_clear_errors(gen):
    qkv, cos_sin, positions, slots, cache = problem(*NORM_SHAPES[0], torch.float32, gen)
    query = torch.empty(qkv.shape[0], 8, 128)
    q_norm, k_norm = norm_weights(128, torch.float32, gen)
    with pytest.raises(ValueError, match="q_norm and k_norm come together: k_norm is missing"):
        ops.qkv_rope_cache(query, qkv, positions, cos_sin, cache[0], cache[1], slots, q_norm, None, EPS)
    with pytest.raises(ValueError, match="qkv_rope_cache: k_norm"):
        ops.qkv_rope_cache(query, qkv, positions, cos_sin, cache[0], cache[1], slots, q_norm, k_norm[:64], EPS)
    with pytest.raises(ValueError, match="eps must be >= 0"):
        ops.qkv_rope_cache(query, qkv, positions, cos_sin, cache[0], cache[1], slots, q_norm, k_norm, -1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_q_k_norms_on_cuda_need_rope_over_whole_heads(gen):
    qkv, cos_sin, positions, slots, cache = (t.cuda() for t in problem(*SHAPES[1], torch.bfloat16, gen))
    norms = [w.cuda() for w in norm_weights(64, torch.bfloat16, gen)]
    query = torch.empty(qkv.shape[0], 4, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="q/k norms need rope over the whole head"):
        ops.qkv_rope_cache(query, qkv, positions, cos_sin, cache[0], cache[1], slots, *norms, EPS)
