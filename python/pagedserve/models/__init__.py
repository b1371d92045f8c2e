"""Model registry: HF architecture name -> our implementation, and build_model."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from pagedserve.models.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.weights import load_weights

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
assert set(MODEL_REGISTRY) == set(SUPPORTED_ARCHITECTURES), "config and registry must agree"


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[architecture]


def build_model(model_config: ModelConfig, device: Union[str, torch.device, None] = None,
                load_format: str = "auto", seed: int = 0) -> LlamaForCausalLM:
    """Allocates the model on ``device`` (default: the config's) in the config's dtype and fills its weights.

    load_format: "auto" / "safetensors" read ``model_config.model_dir``; "dummy" draws seeded random weights.
    """
    target: Optional[torch.device] = torch.device(device) if device is not None else model_config.device
    model = model_class(model_config.architecture)(model_config, target)
    load_weights(model, model_config.model_dir, load_format=load_format, seed=seed)
    return model.eval()


__all__ = ["MODEL_REGISTRY", "build_model", "model_class"]
