"""pagedserve.ops (the CPU kernels) against torch and HF transformers: norms,
activation, rotary embeddings, KV-cache writes and argument checking."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F
from ops_testing import DTYPES, TOL, cpu_isa, gen, randn, torch_single_thread  # noqa: F401  (fixtures)
from torch.utils.dlpack import to_dlpack
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from pagedserve import _core, ops


# ---------------------------------------------------------------------------
# Norms and activation


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 67), (33, 1024)])
def test_rms_norm_matches_hf(dtype, rows, hidden, gen, cpu_isa):
    x = randn(rows, hidden, gen=gen, dtype=dtype, scale=3.0)
    norm = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(hidden, gen=gen, dtype=dtype))
        expected = norm(x)
    out = torch.full_like(x, float("nan"))
    ops.rms_norm(out, x, norm.weight, 1e-5)
    torch.testing.assert_close(out, expected)


def test_rms_norm_in_place(gen):
    x = randn(5, 96, gen=gen)
    w = randn(96, gen=gen)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    ops.rms_norm(x, x, w, 1e-6)
    torch.testing.assert_close(x, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_hf(dtype, gen, cpu_isa):
    rows, hidden = 9, 576
    x = randn(rows, hidden, gen=gen, dtype=dtype)
    residual = randn(rows, hidden, gen=gen, dtype=dtype, scale=4.0)
    norm = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(hidden, gen=gen, dtype=dtype))
        expected_residual = residual + x  # HF: hidden_states = residual + hidden_states, in the dtype
        expected = norm(expected_residual)
    ops.fused_add_rms_norm(x, residual, norm.weight, 1e-5)
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)
    torch.testing.assert_close(x, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 1536), (13, 37)])
def test_silu_and_mul_matches_torch(dtype, rows, width, gen, cpu_isa):
    x = randn(rows, 2 * width, gen=gen, dtype=dtype, scale=4.0)
    out = torch.full((rows, width), float("nan"), dtype=dtype)
    ops.silu_and_mul(out, x)
    expected = F.silu(x[:, :width]) * x[:, width:]  # in the dtype, like HF's LlamaMLP
    torch.testing.assert_close(out, expected)


def test_silu_and_mul_extremes(cpu_isa):
    x = torch.tensor([[-100.0, -20.0, 0.0, 20.0, 100.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    out = torch.empty(1, 5)
    ops.silu_and_mul(out, x)
    torch.testing.assert_close(out, F.silu(x[:, :5]))


# ---------------------------------------------------------------------------
# Rotary embeddings


def hf_rotary(theta, head_dim, rope_type="default", **scaling):
    params = {"rope_type": rope_type, "rope_theta": theta, **scaling}
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=131072, rope_parameters=params)
    return LlamaRotaryEmbedding(config), params


LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


@pytest.mark.parametrize("rope_type,theta,head_dim", [("default", 10000.0, 64), ("default", 1e6, 128),
                                                      ("llama3", 500000.0, 128), ("llama3", 500000.0, 64)])
def test_rope_cache_matches_hf(rope_type, theta, head_dim):
    rotary, params = hf_rotary(theta, head_dim, rope_type, **(LLAMA3 if rope_type == "llama3" else {}))
    max_position = 20000
    table = ops.rope_cos_sin_cache(max_position, head_dim, theta, params)
    assert table.shape == (max_position, head_dim) and table.dtype == torch.float32
    positions = torch.tensor([[0, 1, 2, 17, 1000, 8191, 8192, 12345, max_position - 1]])
    cos, sin = rotary(torch.zeros(1), positions)
    half = head_dim // 2
    # HF's float32 cos/sin are within an ulp or two of the correctly rounded ones we store.
    torch.testing.assert_close(table[positions[0], :half], cos[0, :, :half], rtol=0, atol=2e-6)
    torch.testing.assert_close(table[positions[0], half:], sin[0, :, :half], rtol=0, atol=2e-6)


def test_rope_cache_llama3_changes_low_frequencies_only():
    plain = ops.rope_cos_sin_cache(4096, 128, 500000.0)
    scaled = ops.rope_cos_sin_cache(4096, 128, 500000.0, {"rope_type": "llama3", **LLAMA3})
    assert torch.equal(plain[:, :8], scaled[:, :8])  # the fastest rotations are untouched
    assert not torch.allclose(plain[:, 60:64], scaled[:, 60:64])


def test_rope_cache_rejects_unknown_scaling():
    with pytest.raises(ValueError, match="yarn"):
        ops.rope_cos_sin_cache(16, 64, 10000.0, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="missing"):
        ops.rope_cos_sin_cache(16, 64, 10000.0, {"rope_type": "llama3", "factor": 8.0})


def reference_rotary(positions, x, cos_sin):
    """HF's apply_rotary_pos_emb in float32 on the first R dims; the rest pass through."""
    rotary_dim = cos_sin.shape[1]
    half = rotary_dim // 2
    cos = cos_sin[positions.long(), :half].repeat(1, 2)
    sin = cos_sin[positions.long(), half:].repeat(1, 2)
    xf = x.float()
    rotated, _ = apply_rotary_pos_emb(xf[..., :rotary_dim], xf[..., :rotary_dim], cos, sin, unsqueeze_dim=1)
    return torch.cat([rotated, xf[..., rotary_dim:]], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 128), (64, 32), (80, 40)])
def test_rotary_embedding_matches_hf(dtype, head_dim, rotary_dim, gen, cpu_isa):
    tokens, q_heads, kv_heads = 11, 9, 3
    table = ops.rope_cos_sin_cache(4096, rotary_dim, 10000.0)
    positions = torch.randint(0, 4096, (tokens,), generator=gen, dtype=torch.int32)
    query = randn(tokens, q_heads, head_dim, gen=gen, dtype=dtype)
    key = randn(tokens, kv_heads, head_dim, gen=gen, dtype=dtype)
    expected_q = reference_rotary(positions, query, table)
    expected_k = reference_rotary(positions, key, table)
    ops.rotary_embedding(positions, query, key, table)
    torch.testing.assert_close(query.float(), expected_q, **TOL[dtype])
    torch.testing.assert_close(key.float(), expected_k, **TOL[dtype])


def test_rotary_embedding_rejects_out_of_range_position(gen):
    table = ops.rope_cos_sin_cache(32, 64, 10000.0)
    query = randn(2, 2, 64, gen=gen)
    key = randn(2, 1, 64, gen=gen)
    with pytest.raises(ValueError, match=r"positions\[1\] = 32 is outside"):
        ops.rotary_embedding(torch.tensor([3, 32], dtype=torch.int32), query, key, table)


# ---------------------------------------------------------------------------
# KV cache writes and copies


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_writes_slots_and_skips_padding(dtype, gen):
    num_blocks, kv_heads, block_size, head_dim, tokens = 6, 3, 16, 64, 20
    key_cache = randn(num_blocks, kv_heads, block_size, head_dim, gen=gen, dtype=dtype)
    value_cache = randn(num_blocks, kv_heads, block_size, head_dim, gen=gen, dtype=dtype)
    key = randn(tokens, kv_heads, head_dim, gen=gen, dtype=dtype)
    value = randn(tokens, kv_heads, head_dim, gen=gen, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(torch.int32)
    slots[[3, 11]] = -1
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // block_size, :, slot % block_size] = key[t]
            expected_v[slot // block_size, :, slot % block_size] = value[t]
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


def test_reshape_and_cache_rejects_bad_slot(gen):
    key_cache = torch.zeros(2, 1, 4, 8)
    key = randn(2, 1, 8, gen=gen)
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 8 is outside"):
        ops.reshape_and_cache(key, key, key_cache, key_cache.clone(), torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = -2"):
        ops.reshape_and_cache(key, key, key_cache, key_cache.clone(), torch.tensor([-2, 0], dtype=torch.int32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_applies_copies_in_order(dtype, gen):
    kv_cache = randn(3, 2, 7, 2, 4, 16, gen=gen, dtype=dtype)
    # (1 -> 4) then (4 -> 5): block 5 must receive block 1's data, not 4's old data.
    copies = torch.tensor([[1, 4], [4, 5], [0, 2], [6, 6]], dtype=torch.int32)
    expected = kv_cache.clone()
    for src, dst in copies.tolist():
        expected[:, :, dst] = expected[:, :, src].clone()
    ops.copy_blocks(kv_cache, copies)
    assert torch.equal(kv_cache, expected)


def test_copy_blocks_rejects_bad_block():
    with pytest.raises(ValueError, match=r"block_copies\[0\]\[1\] = 7"):
        ops.copy_blocks(torch.zeros(1, 2, 7, 1, 4, 8), torch.tensor([[0, 7]], dtype=torch.int32))


# ---------------------------------------------------------------------------
# Argument checks at the Python boundary


def test_errors_name_op_and_argument(gen):
    x = randn(4, 64, gen=gen)
    w = randn(64, gen=gen)
    out = torch.empty_like(x)
    with pytest.raises(ValueError, match=r"rms_norm: x must be float32, float16 or bfloat16, got float64"):
        ops.rms_norm(out, x.double(), w, 1e-5)
    with pytest.raises(ValueError, match=r"rms_norm: weight must have the same dtype"):
        ops.rms_norm(out, x, w.half(), 1e-5)
    with pytest.raises(ValueError, match=r"rms_norm: weight must have size 64 in dim 0, got float32\[32\] cpu"):
        ops.rms_norm(out, x, w[:32].contiguous(), 1e-5)
    with pytest.raises(ValueError, match=r"rms_norm: x must be contiguous, got float32\[64, 4\] strides \[1, 64\] cpu"):
        ops.rms_norm(out.t(), x.t(), w, 1e-5)
    with pytest.raises(ValueError, match=r"silu_and_mul: x must have 2 dims"):
        ops.silu_and_mul(out, x[None])
    with pytest.raises(ValueError, match=r"rotary_embedding: positions must be int32, got int64"):
        ops.rotary_embedding(torch.zeros(4, dtype=torch.int64), x.view(4, 1, 64), x.view(4, 1, 64).clone(),
                             ops.rope_cos_sin_cache(8, 64, 10000.0))
    with pytest.raises(ValueError, match=r"paged_attention: query must have 3 dims"):
        ops.paged_attention(out, x, x, x, x, x, x, 1.0, 1, 1)


def test_set_num_threads_validates():
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        ops.set_num_threads(0)


def test_cpu_isa_selection():
    supported = _core.ops.supported_cpu_isas()
    assert supported[0] == "baseline" and ops.cpu_isa() == supported[-1]
    with pytest.raises(ValueError, match="unknown instruction set 'sse9'"):
        _core.ops.set_cpu_isa("sse9")


def test_backend_rejects_other_devices():
    with pytest.raises(ValueError, match="meta"):
        ops.silu_and_mul(torch.empty(2, 4, device="meta"), torch.empty(2, 8, device="meta"))


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


# PyCapsule_New keeps the name pointer, so the names must outlive the capsules.
_CAPSULE_NAMES = {name: ctypes.create_string_buffer(name.encode()) for name in ("dltensor", "used_dltensor")}


def fake_capsule(tensor, device_type=1, lanes=1, name="dltensor"):
    """A borrowed DLPack capsule over `tensor`'s memory that can claim another device or dtype."""
    shape = (ctypes.c_int64 * tensor.dim())(*tensor.shape)
    managed = _DLManagedTensor()
    managed.dl_tensor = _DLTensor(tensor.data_ptr(), _DLDevice(device_type, 0), tensor.dim(),
                                  _DLDataType(2, 32, lanes), shape, None, 0)
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    capsule = new_capsule(ctypes.addressof(managed), ctypes.addressof(_CAPSULE_NAMES[name]), None)
    return capsule, (managed, shape, tensor)  # the second value keeps the memory alive


def test_wrong_device_and_bad_capsules(gen):
    x = randn(3, 16, gen=gen)
    w = randn(16, gen=gen)
    out = torch.empty_like(x)
    cuda_weight, keep = fake_capsule(w, device_type=2)
    with pytest.raises(ValueError, match=r"rms_norm: weight must be on the cpu, got float32\[16\] cuda:0"):
        _core.ops.rms_norm(to_dlpack(out), to_dlpack(x), cuda_weight, 1e-5)
    vector_weight, keep2 = fake_capsule(w, lanes=4)
    with pytest.raises(ValueError, match=r"rms_norm: weight: vector dtypes"):
        _core.ops.rms_norm(to_dlpack(out), to_dlpack(x), vector_weight, 1e-5)
    used, keep3 = fake_capsule(w, name="used_dltensor")
    with pytest.raises(ValueError, match=r"rms_norm: weight must be a 'dltensor' capsule"):
        _core.ops.rms_norm(to_dlpack(out), to_dlpack(x), used, 1e-5)
    # A null-strides (compact) capsule is read as row-major and works.
    compact, keep4 = fake_capsule(w)
    _core.ops.rms_norm(to_dlpack(out), to_dlpack(x), compact, 1e-5)
    torch.testing.assert_close(out, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w)
    del keep, keep2, keep3, keep4


# ---------------------------------------------------------------------------
# One call shape for the CPU and the CUDA module (cpp/bindings/op_binding.h)

_SHARED_OPS = ["rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "reshape_and_cache",
               "copy_blocks", "paged_attention", "grouped_linear", "sample_tokens"]


def _parameter_names(fn) -> list[str]:
    signature = fn.__doc__.splitlines()[0]
    return [p.split(":")[0].strip() for p in signature[signature.index("(") + 1:signature.rindex(")")].split(", ")]


def test_cpu_ops_take_the_trailing_stream_of_the_cuda_ops(gen):
    x = randn(3, 16, gen=gen)
    w = randn(16, gen=gen)
    out = torch.empty_like(x)
    _core.ops.rms_norm(to_dlpack(out), to_dlpack(x), to_dlpack(w), 1e-5, stream=0)
    torch.testing.assert_close(out, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w)
    with pytest.raises(ValueError, match=r"rms_norm: stream must be 0 for the cpu ops"):
        _core.ops.rms_norm(to_dlpack(out), to_dlpack(x), to_dlpack(w), 1e-5, stream=1234)
    for name in _SHARED_OPS:
        assert _parameter_names(getattr(_core.ops, name))[-1] == "stream", name


@pytest.mark.skipif(not _core.has_cuda, reason="needs pagedserve._core built with USE_CUDA=ON (no GPU needed)")
def test_cpu_and_cuda_ops_have_one_call_shape():
    for name in _SHARED_OPS:
        assert _parameter_names(getattr(_core.ops, name)) == _parameter_names(getattr(_core.cuda_ops, name)), name
