"""How a Linear's weight is stored and multiplied on the CPU: one small class per format.

A Linear keeps torch's F.linear over its float weight until a kernel replaces the
weight (``Linear.use_kernel``); the kernel then owns the weight's bytes and computes
y = x W^T + b. Every format the engine runs (bf16 tiles, int8 channels, GGUF blocks)
is one class here or in its own module with the same two members, so a layer never
branches on how its weights are kept.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from pagedserve import ops


class LinearKernel(Protocol):
    out_features: int
    quantized: bool = False  # the weight kept quantized in memory (int8 channels, GGUF blocks)

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x [M, K] -> [M, out_features] in x's dtype."""

    def nbytes(self) -> int:
        """Bytes the weight occupies (what a step streams)."""

    def float64_sums(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """x W^T [M, out_features] float64, every sum formed in float64 and no bias, where this format's
        arithmetic is float32 (layers.Linear's float64_sums); None where it is not (activations rounded to
        bf16 or int8, GGUF blocks), and such a product sums as it always does."""
        return None


class PackedBf16(LinearKernel):
    """The weight as bf16 tiles (cpp/ops/packed_weight_layout.h), float32 arithmetic: exact for a weight that
    is exactly bf16, rounded otherwise (see cpu_weight_packing.py)."""

    def __init__(self, weight: torch.Tensor):
        self.out_features = weight.shape[0]
        self.packed = ops.pack_linear_weight(weight)

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        ops.packed_linear(out, x, self.packed, bias)
        return out

    def float64_sums(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float64)
        ops.packed_linear_float64_sums(out, x, self.packed, None)
        return out

    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


class PackedBf16Activations(PackedBf16):
    """The same bf16 tiles with bf16 activations (EngineConfig.cpu_precision "bfloat16"): each row of x is
    rounded to bf16 on the way in and the products run as bf16 dot products (AVX512_BF16 / AMX), float32 sums
    and a float32 result. Twice the multiply-adds per instruction of PackedBf16's float32 FMAs."""

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        ops.packed_linear_bf16(out, x, self.packed, bias)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def float64_sums(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        return None  # bf16 activations: the products themselves are rounded


class PackedBf16Rows:
    """Rows of a matrix [N, K] gathered back from its bf16 tiles, widened to float32: a tied LM head's
    tiles serve the embedding lookups too, so a bf16 checkpoint's table is held once (layers.Embedding.
    read_from_tiles). Layout (cpp/ops/packed_weight_layout.h): packed[t, p, 2c + i] = W[16t + c, 2p + i]."""

    def __init__(self, packed: torch.Tensor, num_rows: int, row_size: int):
        self.packed, self.num_rows, self.row_size = packed, num_rows, row_size

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        tiles, pairs = self.packed.shape[0], self.packed.shape[1]
        flat = ids.reshape(-1).long()
        rows = self.packed.view(tiles, pairs, 16, 2)[flat // 16, :, flat % 16, :]  # [M, pairs, 2]
        out = rows.reshape(flat.shape[0], 2 * pairs)[:, :self.row_size].to(torch.float32)
        return out.reshape(*ids.shape, self.row_size)


def has_quantized_weights(model: torch.nn.Module) -> bool:
    """Whether any of the model's linears keeps its weight quantized (worker/kv_cache.py's rule)."""
    return any(getattr(getattr(m, "kernel", None), "quantized", False) for m in model.modules())


__all__ = ["LinearKernel", "PackedBf16", "PackedBf16Activations", "PackedBf16Rows", "has_quantized_weights"]
