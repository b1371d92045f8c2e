"""GGUF weights kept as the file's blocks on the CPU: a LinearKernel and an embedding row lookup.

A merged projection (q/k/v, gate/up) is one ``GgufLinear`` over row segments, one per
source tensor; segments of one ggml type are joined into one block matrix (one kernel
call), and files that quantize, say, attn_v differently from attn_q (llama.cpp's
Q4_K_M does) keep a segment per type, each written into its columns of the output.
Dense (F32/F16/BF16) segments multiply through torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from pagedserve import ops
from pagedserve.models.linear_kernels import LinearKernel


@dataclass(frozen=True)
class Segment:
    """Rows of a weight: GGUF blocks [rows, row_bytes] uint8 of ggml type ``ggml_type``, or a dense float
    matrix [rows, K] (ggml_type None)."""

    weight: torch.Tensor
    ggml_type: Optional[int]

    @property
    def rows(self) -> int:
        return self.weight.shape[0]

    def interleaved(self) -> "Segment":
        """The same rows in the layout gguf_linear multiplies fastest (eight rows interleaved:
        cpp/ops/gguf_interleaved.h), where this CPU has a kernel for it; else this segment."""
        made = None if self.ggml_type is None else ops.gguf_interleave(self.weight, self.ggml_type)
        return self if made is None else Segment(*made)


def merge_segments(segments: Sequence[Segment]) -> list[Segment]:
    """Joins neighbouring segments of the same ggml type (same K, so the same row bytes)."""
    merged: list[Segment] = []
    for segment in segments:
        if merged and segment.ggml_type is not None and merged[-1].ggml_type == segment.ggml_type:
            merged[-1] = Segment(torch.cat([merged[-1].weight, segment.weight]), segment.ggml_type)
        else:
            merged.append(segment)
    return merged


class GgufLinear(LinearKernel):
    """y = x W^T (+ b) with W's rows as GGUF blocks (ops.gguf_linear: float32 arithmetic, or int8 activations
    on AVX2 CPUs and above)."""

    quantized = True

    def __init__(self, segments: Sequence[Segment]):
        self.segments = merge_segments(segments)
        self.out_features = sum(segment.rows for segment in self.segments)

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        x32 = x if x.dtype == torch.float32 else x.float()
        bias32 = None if bias is None else bias.float()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        row = 0
        for segment in self.segments:
            cols = slice(row, row + segment.rows)
            part_bias = None if bias32 is None else bias32[cols]
            if segment.ggml_type is None:
                out[:, cols] = F.linear(x32, segment.weight.float(), part_bias)
            else:
                ops.gguf_linear(out[:, cols], x32, segment.weight, segment.ggml_type, part_bias)
            row += segment.rows
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    @property
    def one_segment(self) -> Optional[Segment]:
        """The weight as one block matrix of one ggml type, or None (rows of several types, or dense rows)."""
        only = self.segments[0]
        return only if len(self.segments) == 1 and only.ggml_type is not None else None

    def nbytes(self) -> int:
        return sum(segment.weight.numel() * segment.weight.element_size() for segment in self.segments)


class GgufRows:
    """An embedding table kept as GGUF blocks: a lookup decodes only the rows asked for."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, dim: int, dtype: torch.dtype):
        self.blocks = blocks
        self.ggml_type = ggml_type
        self.dim = dim
        self.dtype = dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.dtype not in (torch.int32, torch.int64):
            flat = flat.to(torch.int64)
        out = torch.empty(flat.shape[0], self.dim, dtype=torch.float32)
        ops.gguf_dequantize_rows(out, self.blocks, self.ggml_type, flat.contiguous())
        out = out.view(*ids.shape, self.dim)
        return out if self.dtype == torch.float32 else out.to(self.dtype)

    def nbytes(self) -> int:
        return self.blocks.numel()


__all__ = ["GgufLinear", "GgufRows", "Segment", "merge_segments"]
