"""The engine's kernels, as the model code calls them.

Every function takes torch tensors, converts each to a DLPack capsule once (no
copy) and calls the kernel for the tensors' device with the same arguments on
either: `kernels, stream = _backend(tensor)`, then
`kernels.<op>(capsules and scalars..., stream)` (cpp/bindings/op_binding.h).
`_backend` is the one place the device is looked at. All argument checking
happens in C++, one contract per op for both devices (cpp/ops/op_contracts.h),
which raises ValueError naming the op and the argument (bad dtype, shape,
stride or device).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch.utils.dlpack import to_dlpack as _dl

from pagedserve import _core
from pagedserve.gguf_ops import gguf_dequantize_rows, gguf_interleave, gguf_linear  # noqa: F401  (the same)
from pagedserve.int8_weights import Int8Weight, quantize_int8_weight  # noqa: F401  (part of the ops' interface)

_cpu_ops = _core.ops

__all__ = [
    "rms_norm", "fused_add_rms_norm", "rope_cos_sin_cache", "rotary_embedding", "silu_and_mul", "reshape_and_cache",
    "copy_blocks", "paged_attention", "grouped_linear", "small_batch_linear", "qkv_rope_cache",
    "qkv_linear_rope_cache", "MAX_SMALL_BATCH_ROWS", "set_num_threads", "num_threads", "cpu_isa", "sample_tokens",
    "pack_linear_weight", "packed_linear", "packed_linear_bf16", "packed_linear_float64_sums", "cpu_kernels",
    "Int8Weight", "quantize_int8_weight", "int8_linear", "pack_grouped_weight", "packed_grouped_linear", "gguf_linear",
    "gguf_dequantize_rows", "gguf_interleave", "wait_for_flag",
]


_HOST_STREAM = 0
# The current CUDA stream of a device as a raw pointer: torch's own accessor (the one its compiled kernels use),
# ~1 us, against ~15 us a call for torch.cuda.current_stream(device).cuda_stream on an H200 host (113 calls in
# a 24-token TinyLlama prefill, ~2 ms of its host time).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or \
    (lambda index: torch.cuda.current_stream(index).cuda_stream)


def _backend(tensor: torch.Tensor) -> tuple[Any, int]:
    """The kernel module for tensors on `tensor`'s device, and the stream its functions take last:
    0 on the CPU (the ops run on the calling thread), the caller's current CUDA stream on a GPU
    (kernels run on it, so they order with torch's work and are captured by CUDA graphs)."""
    if tensor.is_cpu:
        return _cpu_ops, _HOST_STREAM
    if tensor.is_cuda:
        if not _core.has_cuda:
            raise ValueError("pagedserve.ops: CUDA tensors need the extension built with USE_CUDA=ON "
                             "(pip install -C cmake.define.USE_CUDA=ON .)")
        return _core.cuda_ops, _raw_stream(tensor.get_device())
    raise ValueError(f"pagedserve.ops: no kernels for tensors on {tensor.device}")


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, fixed_order: bool = False) -> None:
    """out = x / sqrt(mean(x^2, -1) + eps) * weight.  x, out: [T, H]; weight: [H]. On a GPU a row is summed in
    torch's order for T rows (bit-identical to transformers); fixed_order: in one fixed by H alone
    (batch-invariant). The CPU always uses the latter."""
    kernels, stream = _backend(x)
    kernels.rms_norm(_dl(out), _dl(x), _dl(weight), eps, fixed_order, stream)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       fixed_order: bool = False) -> None:
    """In place: residual += x; x = rms_norm(residual) * weight (fixed_order: as rms_norm)."""
    kernels, stream = _backend(x)
    kernels.fused_add_rms_norm(_dl(x), _dl(residual), _dl(weight), eps, fixed_order, stream)


def _llama3_scaling(scaling: Optional[Mapping[str, Any]]) -> Optional[dict]:
    """The llama3 parameters of an HF rope_scaling / rope_parameters dict, or None for plain rope."""
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ValueError(f"rope_cos_sin_cache: rope_type {rope_type!r} is not supported (only 'default' and 'llama3')")
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
               if k not in scaling]
    if missing:
        raise ValueError(f"rope_cos_sin_cache: llama3 scaling is missing {missing}")
    return dict(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position=int(scaling["original_max_position_embeddings"]),
    )


def rope_cos_sin_cache(
    max_position: int,
    rotary_dim: int,
    theta: float,
    scaling: Optional[Mapping[str, Any]] = None,
    device: Optional[torch.device | str] = None,
) -> torch.Tensor:
    """The float32 [max_position, rotary_dim] table [cos | sin] of each position's rotary angles.

    scaling: HF's rope_scaling / rope_parameters dict. rope_type 'llama3' (factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings) rescales the frequencies; None or 'default' does not.
    """
    table = torch.empty((max_position, rotary_dim), dtype=torch.float32)
    params = _llama3_scaling(scaling) or {}
    _cpu_ops.rope_cos_sin_cache(_dl(table), float(theta), **params)
    return table if device is None else table.to(device)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """In place NeoX-style rope.  positions: [T] int32; query: [T, Hq, D]; key: [T, Hkv, D]."""
    kernels, stream = _backend(query)
    kernels.rotary_embedding(_dl(positions), _dl(query), _dl(key), _dl(cos_sin_cache), stream)


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """out = silu(x[:, :I]) * x[:, I:].  x: [T, 2I]; out: [T, I]."""
    kernels, stream = _backend(x)
    kernels.silu_and_mul(_dl(out), _dl(x), stream)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Writes key/value [T, Hkv, D] into the caches [N, Hkv, B, D] at slot_mapping [T] (-1: skip)."""
    kernels, stream = _backend(key)
    kernels.reshape_and_cache(_dl(key), _dl(value), _dl(key_cache), _dl(value_cache), _dl(slot_mapping), stream)


def copy_blocks(kv_cache: torch.Tensor, block_copies: torch.Tensor) -> None:
    """For each (src, dst) row of block_copies [C, 2], in order: every layer's block dst = block src."""
    kernels, stream = _backend(kv_cache)
    kernels.copy_blocks(_dl(kv_cache), _dl(block_copies), stream)


def paged_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    max_query_len: int, max_seq_len: int, num_decodes: int = 0,
                    workspace: Optional[torch.Tensor] = None, window: int = 0, softcap: float = 0.0,
                    fixed_split: bool = False, decode_order: Optional[torch.Tensor] = None) -> None:
    """Causal attention of each sequence's queries over its paged context (see cpp/ops/ops.h).

    max_query_len, max_seq_len and num_decodes are host-side launch bounds for the CUDA kernels and
    workspace their split-K scratch; the CPU kernel takes and ignores them.
    window > 0: sliding window, the query at position p sees keys p - window < k <= p (transformers'
    sliding_window_causal); blocks wholly before every query's window are never read, so their block-table
    entries may hold anything. softcap > 0: scores s = scale * q.k become softcap * tanh(s / softcap) before
    the softmax (Gemma 2). 0 turns either off (cpp/ops/attention_options.h). fixed_split: the CUDA decode
    kernel splits a row's context by the context alone, so its result does not depend on the batch (the CPU
    kernel always does). decode_order: int32 [num_decodes], a permutation of the decode rows, the order the
    CUDA kernel launches them in (the runner's is longest context first): a permutation changes no result
    (a row it omits may go uncomputed, cuda/cuda_ops.h).
    """
    kernels, stream = _backend(query)
    kernels.paged_attention(_dl(out), _dl(query), _dl(key_cache), _dl(value_cache), _dl(block_tables),
                            _dl(query_start_loc), _dl(seq_lens), scale, max_query_len, max_seq_len, num_decodes,
                            None if workspace is None else _dl(workspace), int(window), float(softcap),
                            bool(fixed_split), None if decode_order is None else _dl(decode_order), stream)


def paged_attention_workspace(num_seqs: int, num_heads: int, head_dim: int, max_seq_len: int,
                              device: torch.device) -> Optional[torch.Tensor]:
    """The split-K scratch the CUDA decode kernel needs (allocated once by the runner); None on the CPU."""
    if torch.device(device).type != "cuda":
        return None
    nbytes = _core.cuda_ops.paged_attention_workspace_bytes(num_seqs, num_heads, head_dim, max_seq_len)
    return torch.empty((nbytes + 3) // 4, dtype=torch.float32, device=device)


def qkv_rope_cache(query_out: torch.Tensor, qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                   key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   q_norm: Optional[torch.Tensor] = None, k_norm: Optional[torch.Tensor] = None,
                   eps: float = 0.0) -> None:
    """From qkv [T, (Hq + 2 Hkv) D]: query_out [T, Hq, D] = rotated q; rotated k and v into the caches
    [N, Hkv, B, D] at slot_mapping [T] (-1: skip). The same as rotary_embedding then reshape_and_cache on the
    column slices, in one pass on a GPU. q_norm, k_norm [D] (both or neither): rms_norm(eps) of every q and k
    head first, bit for bit as rms_norm of the heads (on a GPU: rope over whole heads, head_dim <= 128)."""
    kernels, stream = _backend(qkv)
    kernels.qkv_rope_cache(_dl(query_out), _dl(qkv), _dl(positions), _dl(cos_sin_cache), _dl(key_cache),
                           _dl(value_cache), _dl(slot_mapping), None if q_norm is None else _dl(q_norm),
                           None if k_norm is None else _dl(k_norm), float(eps), stream)


MAX_SMALL_BATCH_ROWS = 8  # cpp/ops/op_contracts.h kMaxSmallBatchRows


def qkv_linear_rope_cache(query_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          positions: torch.Tensor, cos_sin_cache: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """small_batch_linear then qkv_rope_cache, bit for bit, for 1..4 rows of x [M, K], in one kernel on a GPU."""
    kernels, stream = _backend(x)
    tensors = (query_out, x, weight, bias, positions, cos_sin_cache, key_cache, value_cache, slot_mapping)
    kernels.qkv_linear_rope_cache(*(None if t is None else _dl(t) for t in tensors), stream)


def small_batch_linear(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                       gated: bool = False) -> None:
    """out = x weight^T (+ bias) for 1..8 rows of x [M, K], weight [N, K] (a decode step's product; on a GPU one
    memory-bound kernel, on the CPU its plain-loop reference). gated: weight = [gate; up] ([2I, K]) and
    out [M, I] = silu(gate) * up."""
    kernels, stream = _backend(x)
    kernels.small_batch_linear(_dl(out), _dl(x), _dl(weight), None if bias is None else _dl(bias), gated, stream)


def grouped_linear(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, expert_offsets: torch.Tensor) -> None:
    """Mixture-of-experts expert products in one call (layout: cpp/ops/grouped_linear.h).

    x [R, K]: rows sorted by expert; expert_offsets [E + 1] int32: expert e owns rows
    expert_offsets[e]:expert_offsets[e + 1]; weight [E, N, K]: each expert's nn.Linear weight.
    out [R, N]: out[r] = x[r] @ weight[e].T for every row of every expert (float32 accumulation);
    rows outside expert_offsets[0]:expert_offsets[E] are not written. All float tensors share a dtype.
    """
    kernels, stream = _backend(x)
    kernels.grouped_linear(_dl(out), _dl(x), _dl(weight), _dl(expert_offsets), stream)


def sample_tokens(out: torch.Tensor, logits: torch.Tensor, inv_temperature: torch.Tensor, seed: int,
                  allowed: Optional[torch.Tensor] = None) -> None:
    """out[r] = argmax_v(logits[r, v] * inv_temperature[r] + gumbel noise(seed, r, v)): a draw from
    softmax(logits[r] / T) in one pass over the logits; inv_temperature[r] <= 0 means greedy.
    out: [R] int32; logits: [R, V]; inv_temperature: [R] float32; seed: 0 <= seed < 2**64;
    allowed: None, or an int32 [R, ceil(V / 32)] bitmask of the eligible tokens (bit v % 32 of word
    v // 32: a grammar's mask), the others sampled as if their logits were -inf."""
    kernels, stream = _backend(logits)
    kernels.sample_tokens(_dl(out), _dl(logits), _dl(inv_temperature), None if allowed is None else _dl(allowed),
                          seed, stream)


def wait_for_flag(flag: torch.Tensor, target: int, device: torch.device, timeout_seconds: float = 60.0) -> None:
    """Until flag[0] >= target (an int64 [2] host tensor another thread raises): on a CUDA `device` its current
    stream waits (flag pinned), on the CPU the calling thread (the GIL dropped). After timeout_seconds flag[1]
    becomes 1 and the wait ends: the caller reports it."""
    if device.type != "cuda":
        return _cpu_ops.wait_for_flag(_dl(flag), target, timeout_seconds, _HOST_STREAM)
    index = device.index if device.index is not None else torch.cuda.current_device()
    _core.cuda_ops.wait_for_flag(_dl(flag), target, timeout_seconds, _raw_stream(index))


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A CPU weight [N, K] in the bf16 tile layout packed_linear reads (cpp/ops/packed_weight_layout.h):
    [ceil(N / 16), round_up(K, 32) / 2, 32] bfloat16. Values are rounded to bf16 (exact for a bf16 checkpoint)."""
    out_features, in_features = weight.shape
    packed = torch.empty((out_features + 15) // 16, (in_features + 31) // 32 * 16, 32, dtype=torch.bfloat16)
    _cpu_ops.pack_linear_weight(_dl(packed), _dl(weight))
    return packed


def packed_linear(out: torch.Tensor, x: torch.Tensor, packed_weight: torch.Tensor,
                  bias: Optional[torch.Tensor] = None) -> None:
    """out = x W^T (+ bias) in float32 on the CPU, W from pack_linear_weight. x [M, K], out [M, N] float32."""
    _cpu_ops.packed_linear(_dl(out), _dl(x), _dl(packed_weight), None if bias is None else _dl(bias))


def packed_linear_float64_sums(out: torch.Tensor, x: torch.Tensor, packed_weight: torch.Tensor,
                               bias: Optional[torch.Tensor] = None) -> None:
    """out = x W^T on the CPU with every sum in float64 (a row-parallel product under float32: layers.Linear's
    float64_sums). x [M, K] float32; out [M, N] float32 (the rounded sums + bias) or float64 (the sums alone)."""
    _cpu_ops.packed_linear_float64_sums(_dl(out), _dl(x), _dl(packed_weight), None if bias is None else _dl(bias))


def packed_linear_bf16(out: torch.Tensor, x: torch.Tensor, packed_weight: torch.Tensor,
                       bias: Optional[torch.Tensor] = None) -> None:
    """out = bf16(x) W^T (+ bias) on the CPU with bf16 activations (AVX512_BF16 / AMX; see cpu_kernels()):
    x [M, K] float32 (rounded to bf16, nearest-even) or bfloat16; products exact, float32 sums;
    out [M, N] float32 or bfloat16; W from pack_linear_weight; bias float32."""
    _cpu_ops.packed_linear_bf16(_dl(out), _dl(x), _dl(packed_weight), None if bias is None else _dl(bias))


def int8_linear(out: torch.Tensor, x: torch.Tensor, weight: Int8Weight, bias: Optional[torch.Tensor] = None) -> None:
    """out = x W^T (+ bias) on the CPU with W from quantize_int8_weight, never dequantized: x [M, K] (float32 or
    bfloat16) is quantized to int8 on the fly with a scale per 64-block of each row, each block's integer dot
    products are exact (AVX512-VNNI / AMX-int8; see cpu_kernels()), out [M, N] float32; bias float32."""
    _cpu_ops.int8_linear(_dl(out), _dl(x), _dl(weight.packed), _dl(weight.scales), None if bias is None else _dl(bias))


def pack_grouped_weight(weight: torch.Tensor) -> torch.Tensor:
    """CPU expert weights [E, N, K] in packed_linear's bf16 tiles, one expert after another:
    [E, ceil(N / 16), round_up(K, 32) / 2, 32] bfloat16 (values rounded to bf16)."""
    experts, out_features, in_features = weight.shape
    packed = torch.empty((experts, (out_features + 15) // 16, (in_features + 31) // 32 * 16, 32), dtype=torch.bfloat16)
    _cpu_ops.pack_grouped_weight(_dl(packed), _dl(weight))
    return packed


def packed_grouped_linear(out: torch.Tensor, x: torch.Tensor, packed_weight: torch.Tensor,
                          expert_offsets: torch.Tensor) -> None:
    """grouped_linear on the CPU in float32 with weights from pack_grouped_weight: each expert's rows
    expert_offsets[e]:expert_offsets[e + 1] of x [R, K] through packed_linear into out [R, N] (float32)."""
    _cpu_ops.packed_grouped_linear(_dl(out), _dl(x), _dl(packed_weight), _dl(expert_offsets))


def set_num_threads(num_threads: int) -> None:
    """Threads the CPU ops may use, the calling thread included."""
    _cpu_ops.set_num_threads(num_threads)


def num_threads() -> int:
    return _cpu_ops.num_threads()


def cpu_isa() -> str:
    """The instruction set the CPU kernels run with: 'baseline' (SSE2), 'avx2', 'avx512', 'avx512_bf16' (plus
    vdpbf16ps) or 'amx' (AVX-512 plus AMX tiles for the matrix kernels)."""
    return _cpu_ops.cpu_isa()


def cpu_kernels() -> dict[str, str]:
    """The matrix kernel each CPU precision runs with now, for results to report:
    float32 (packed_linear), bfloat16 (packed_linear_bf16) and int8 (int8_linear)."""
    return {"float32": _FLOAT32_KERNELS[_cpu_ops.cpu_isa()], "bfloat16": _cpu_ops.packed_linear_bf16_kernel(),
            "int8": _cpu_ops.int8_linear_kernel()}


# packed_linear's kernel at each level (cpp/ops/packed_linear.cc): AMX runs x as three bf16 terms.
_FLOAT32_KERNELS = {"amx": "amx_bf16x3", "avx512_bf16": "avx512_fma", "avx512": "avx512_fma", "avx2": "avx2_fma",
                    "baseline": "baseline"}
