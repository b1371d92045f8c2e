"""The dense MLPs of the decoder layers: the gated one (silu or gelu of gate, times up) of most families, and
Phi-2's plain two-layer one."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.distributed.context import SINGLE, ParallelContext
from pagedserve.models.activations import activation, activation_and_mul
from pagedserve.models.model_config import ModelConfig
from pagedserve.models.parallel_layers import column_linear, row_linear


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelContext = SINGLE):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = column_linear(config.hidden_size, (size, size), config.mlp_bias, dtype, device, parallel)
        self.down_proj = row_linear(size, config.hidden_size, config.mlp_bias, dtype, device, parallel)
        self.act = activation_and_mul(config.hidden_act)
        self.fused_silu = config.hidden_act == "silu"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gated = self.gate_up_proj.gated_forward(hidden) if self.fused_silu else None
        if gated is None:
            gated = self.act(self.gate_up_proj(hidden))
        return self.down_proj(gated)


class DenseMLP(nn.Module):
    """Phi-2's MLP: fc2(act(fc1(x))), both with biases."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelContext = SINGLE):
        super().__init__()
        self.fc1 = column_linear(config.hidden_size, (config.intermediate_size,), True, dtype, device, parallel)
        self.fc2 = row_linear(config.intermediate_size, config.hidden_size, True, dtype, device, parallel)
        self.act = activation(config.hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(hidden)))
