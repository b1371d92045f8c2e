"""int8 per-channel weights (EngineConfig.quantization "int8"): a LinearKernel made at load from any float
checkpoint.

Each output channel n keeps int8 values q[n, :] and one float32 scale (max |W[n, :]| / 127), packed for
AVX512-VNNI / AMX-int8 (cpp/ops/int8_weight_layout.h): 1 byte per parameter plus 4 bytes per output channel,
a quarter of float32 and half of bf16 to stream per decode step. Activations are quantized to int8 inside the
kernel with a scale per 64-block of each row and each block's integer products are exact; the weight is never
dequantized as a whole.
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedserve import ops
from pagedserve.models.linear_kernels import LinearKernel


class Int8Linear(LinearKernel):
    quantized = True

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.weight = ops.quantize_int8_weight(weight)

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        ops.int8_linear(out, x, self.weight, None if bias is None else bias.float())
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weight)


__all__ = ["Int8Linear"]
