"""The paged KV cache tensor: one allocation for the whole model, sized once.

Layout (cpp/ops/kv_cache_layout.h is the reference):
    [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]
with keys at index 0 and values at 1 of the second dimension.
"""

from __future__ import annotations

import torch


def kv_cache_shape(num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int,
                   head_dim: int) -> tuple[int, ...]:
    return (num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim)


def bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    element = torch.tensor([], dtype=dtype).element_size()
    return num_layers * 2 * num_kv_heads * block_size * head_dim * element


def allocate_kv_cache(num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Uninitialized on purpose: a slot is always written before any kernel reads it.
    return torch.empty(kv_cache_shape(num_layers, num_blocks, num_kv_heads, block_size, head_dim),
                       dtype=dtype, device=device)
