"""Model registry: HF architecture name -> our implementation, and build_model."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from pagedserve.distributed.context import SINGLE, ParallelContext
from pagedserve.models.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from pagedserve.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, GemmaForCausalLM
from pagedserve.models.granite import GraniteForCausalLM
from pagedserve.models.llama import (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
                                     SmolLM3ForCausalLM)
from pagedserve.models.moe_models import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from pagedserve.models.olmo2 import Olmo2ForCausalLM
from pagedserve.models.phi import PhiForCausalLM
from pagedserve.models.phi3 import Phi3ForCausalLM
from pagedserve.models.weights import ModuleLoaded, load_weights

# HF architecture -> the module that runs it (its config reading: families.SUPPORTED_ARCHITECTURES).
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "PhiForCausalLM": PhiForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}
assert set(MODEL_REGISTRY) == set(SUPPORTED_ARCHITECTURES), "config and registry must agree"


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[architecture]


def build_model(model_config: ModelConfig, device: Union[str, torch.device, None] = None,
                load_format: str = "auto", seed: int = 0, parallel: ParallelContext = SINGLE,
                on_module_loaded: Optional[ModuleLoaded] = None) -> nn.Module:
    """Allocates the model on ``device`` (default: the config's) in the config's dtype and fills its weights.

    load_format: "auto" / "safetensors" / "pt" read ``model_config.model_dir``; "dummy" draws seeded random weights.
    parallel: a tensor-parallel rank's context: the model holds, and reads from the checkpoint, its shard only.
    on_module_loaded: called as each module's parameters are filled from a checkpoint (weights.py).
    """
    target: Optional[torch.device] = torch.device(device) if device is not None else model_config.device
    cls = model_class(model_config.architecture)
    model = cls(model_config, target, parallel) if parallel.is_parallel else cls(model_config, target)
    load_weights(model, model_config.model_dir, load_format=load_format, seed=seed, on_module_loaded=on_module_loaded)
    return model.eval()


__all__ = ["MODEL_REGISTRY", "build_model", "model_class"]
