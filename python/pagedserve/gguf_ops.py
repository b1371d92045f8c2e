"""The CPU ops over GGUF quantized blocks (cpp/ops/gguf_ops.h), re-exported by ``pagedserve.ops``.

Blocks stay as the file stores them ([N, row_bytes] uint8 of a ggml type), or interleaved eight rows at a time
(gguf_interleave, cpp/ops/gguf_interleaved.h) under the type number plus 256. Arguments are checked in C++
(cpp/ops/gguf_checks.h), which raises ValueError naming the op.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.dlpack import to_dlpack as _dl

from pagedserve import _core

_cpu_ops = _core.ops


def gguf_linear(out: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor, ggml_type: int,
                bias: Optional[torch.Tensor] = None) -> None:
    """out = x W^T (+ bias) in float32 on the CPU, W kept as GGUF blocks [N, row_bytes] uint8 of ggml type
    ``ggml_type`` (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K; cpp/ops/gguf_blocks.h; plus 256 for blocks from
    gguf_interleave); at the AVX2 level and above, every
    format rounds x to int8 per 32-element block first (cpp/ops/gguf_int8.h). x [M, K] float32; out [M, N]
    float32 with contiguous rows (a column slice of a wider tensor is fine)."""
    _cpu_ops.gguf_linear(_dl(out), _dl(x), _dl(blocks), int(ggml_type), None if bias is None else _dl(bias))


def gguf_dequantize_rows(out: torch.Tensor, blocks: torch.Tensor, ggml_type: int, ids: torch.Tensor) -> None:
    """out[r] = row ids[r] of GGUF blocks [N, row_bytes] uint8, decoded to float32. out [R, K]; ids [R] int32/int64."""
    _cpu_ops.gguf_dequantize_rows(_dl(out), _dl(blocks), int(ggml_type), _dl(ids))


def gguf_interleave(blocks: torch.Tensor, ggml_type: int) -> tuple[torch.Tensor, int] | None:
    """GGUF blocks [N, row_bytes] rearranged 8 rows at a time (cpp/ops/gguf_interleaved.h), the layout
    gguf_linear runs fastest, with its type number; None where this process has no kernel for that layout
    (N not a multiple of 8, or below the AVX2 level)."""
    interleaved_type = _cpu_ops.gguf_interleaved_type(int(ggml_type), blocks.shape[0])
    if interleaved_type < 0:
        return None
    out = torch.empty_like(blocks)
    _cpu_ops.gguf_interleave(_dl(out), _dl(blocks), int(ggml_type))
    return out, interleaved_type


__all__ = ["gguf_linear", "gguf_dequantize_rows", "gguf_interleave"]
