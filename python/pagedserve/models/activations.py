"""The MLP activations: SiLU- and GeLU-gated (gate, up) products and the plain activations, each computed as
transformers computes it for the hidden_act names the model families use.

On the CPU in float32, the torch-computed ones are position_free (see there): the same bits for an element
wherever it sits in its tensor, which tensor parallelism moves.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve import ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
        ops.silu_and_mul(out, x)
        return out


def position_free(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """fn, evaluated in float64 and rounded once for float32 CPU tensors. torch's CPU elementwise kernels run
    the last elements of each thread's range (under two vectors) through scalar libm and the rest through SLEEF
    vectors, which differ in the last ulp, so an element's float32 result depends on where it sits in the
    tensor, and tensor parallelism moves it (a rank holds part of each row: Gemma's GeGLU differed by 2e-5 in
    the logprobs, TP = 2 against 1). Both paths round a float64 result to the same float32, but for ties."""
    def run(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu":
            return fn(x.double()).to(torch.float32)
        return fn(x)
    return run


class GeluAndMul(nn.Module):
    """GeGLU: gelu(x[:, :I]) * x[:, I:]; ``approximate`` "tanh" for gelu_pytorch_tanh (Gemma)."""

    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        self.gelu = position_free(lambda x: F.gelu(x, approximate=approximate))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[1] // 2
        return self.gelu(x[:, :half]) * x[:, half:]


def activation(name: str):
    """The plain (ungated) activation for a HF hidden_act name, as transformers computes it (position_free)."""
    if name == "gelu_new":  # transformers' NewGELUActivation, formula for formula
        return position_free(
            lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))))
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return position_free(lambda x: F.gelu(x, approximate="tanh"))
    if name == "gelu":
        return position_free(F.gelu)
    if name == "silu":
        return position_free(F.silu)
    raise ValueError(f"hidden_act {name!r} is not supported")


def activation_and_mul(name: str) -> nn.Module:
    """The gated MLP activation for a HF hidden_act name."""
    if name == "silu":
        return SiluAndMul()
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return GeluAndMul("tanh")
    if name == "gelu":
        return GeluAndMul("none")
    raise ValueError(f"hidden_act {name!r} is not supported")
