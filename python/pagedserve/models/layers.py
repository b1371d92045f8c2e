"""Building blocks shared by the decoder models.

Dense math is torch (``F.linear``); everything with a custom memory layout or
a fusion opportunity goes through ``pagedserve.ops`` (CPU reference ops, or the
CUDA kernels for CUDA tensors). Parameters are allocated uninitialised on the
target device in the target dtype; ``pagedserve.models.weights`` fills them. Nothing
here branches on tensor values, so a forward can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve import ops
from pagedserve.models.attention_metadata import AttentionMetadata


def _empty_parameter(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T + b. ``output_sizes`` lists the row blocks of a merged projection (see weights.py).

    On a CPU the weight may be replaced by bf16 tiles after loading (``pack``,
    see cpu_weight_packing.py); the forward then runs ``ops.packed_linear``.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.output_sizes = tuple(output_sizes)
        self.out_features = sum(self.output_sizes)
        self.weight = _empty_parameter((self.out_features, in_features), dtype, device)
        self.bias = _empty_parameter((self.out_features,), dtype, device) if bias else None
        self.packed_weight: Optional[torch.Tensor] = None

    def pack(self) -> None:
        """Keeps the weight only as bf16 tiles (rounded if it is not exactly bf16)."""
        self.packed_weight = ops.pack_linear_weight(self.weight)
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is None:
            return F.linear(x, self.weight, self.bias)
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        ops.packed_linear(out, x, self.packed_weight, self.bias)
        return out


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = _empty_parameter((num_embeddings, embedding_dim), dtype, device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    is_norm = True  # dummy init sets norm weights to 1

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = _empty_parameter((size,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalises the rows of a contiguous [N, size] tensor into a new tensor."""
        out = torch.empty_like(x)
        ops.rms_norm(out, x, self.weight, self.eps)
        return out

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += x, then x = rms_norm(residual), both in place; returns x."""
        ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x


class RotaryEmbedding(nn.Module):
    """Half-rotation rope with a float32 cos/sin table built once for every position."""

    def __init__(self, rotary_dim: int, max_position: int, theta: float, scaling: Optional[dict],
                 device: torch.device):
        super().__init__()
        table = ops.rope_cos_sin_cache(max_position, rotary_dim, theta, scaling=scaling, device=device)
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> None:
        """Rotates query [T, Hq, D] and key [T, Hkv, D] in place; positions [T] int32."""
        ops.rotary_embedding(positions, query, key, self.cos_sin_cache)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
        ops.silu_and_mul(out, x)
        return out


class PagedAttention(nn.Module):
    """Writes this step's keys/values into the paged cache, then attends through the block tables."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_kv_cache: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D], layer_kv_cache [2, N, Hkv, B, D] -> [T, Hq, D]."""
        key_cache, value_cache = layer_kv_cache[0], layer_kv_cache[1]
        ops.reshape_and_cache(key, value, key_cache, value_cache, attn.slot_mapping)
        out = torch.empty_like(query)
        ops.paged_attention(out, query, key_cache, value_cache, attn.block_tables, attn.query_start_loc,
                            attn.seq_lens, self.scale, attn.max_query_len, attn.max_seq_len,
                            num_decodes=attn.num_decodes, workspace=attn.workspace)
        return out
