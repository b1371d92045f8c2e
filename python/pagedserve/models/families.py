"""The supported HF architectures and how each one's config.json is read.

One entry per architecture: ``SUPPORTED_ARCHITECTURES[name] -> ArchitectureTraits``.
The module class that runs each one is registered next to it in
``pagedserve.models.MODEL_REGISTRY`` (an import-time check keeps the two in step).
Traits say only how to *read* a config; how the network differs (norm kind,
norm placement, activation, embedding scale, checkpoint names) lives in the
family's module (llama.py, gemma.py, phi3.py, olmo2.py, granite.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

FULL = "full_attention"
SLIDING = "sliding_attention"

LayerTypesFn = Callable[[Mapping[str, Any], int], list[str]]


def _all_sliding_if_windowed(hf_config: Mapping[str, Any], num_layers: int) -> list[str]:
    """Mistral, Phi-3: one window for every layer when sliding_window is set."""
    return [SLIDING if hf_config.get("sliding_window") is not None else FULL] * num_layers


def _qwen2_style(hf_config: Mapping[str, Any], num_layers: int) -> list[str]:
    """Qwen2 / SmolLM3 written by transformers 4: layers from max_window_layers on slide, if switched on."""
    if not hf_config.get("use_sliding_window") or hf_config.get("sliding_window") is None:
        return [FULL] * num_layers
    first = int(hf_config.get("max_window_layers") or 0)
    return [SLIDING if i >= first else FULL for i in range(num_layers)]


def _gemma2_style(hf_config: Mapping[str, Any], num_layers: int) -> list[str]:
    """Gemma 2 written by transformers 4: even layers slide, odd layers are global."""
    return [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]


def _gemma3_style(hf_config: Mapping[str, Any], num_layers: int) -> list[str]:
    """Gemma 3 written by transformers 4: every sliding_window_pattern-th layer is global."""
    pattern = int(hf_config.get("sliding_window_pattern") or hf_config.get("_sliding_window_pattern") or 6)
    return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]


@dataclass(frozen=True)
class ArchitectureTraits:
    """How one supported HF architecture's config.json is read (differences from plain Llama)."""

    qkv_bias_key: Optional[str]  # config key switching q/k/v (and o) biases on; None = fixed below
    fixed_qkv_bias: bool = False  # Qwen2: q/k/v always have a bias, o_proj never
    fixed_o_bias: bool = False  # Phi-2: with fixed_qkv_bias, o_proj (``dense``) has one too
    qk_norm: bool = False  # Qwen3, Gemma 3, OLMo2: RMSNorm on q and k before rope
    mlp_bias_key: Optional[str] = None
    activation_keys: tuple[str, ...] = ("hidden_act",)  # first key present names the MLP activation
    activations: tuple[str, ...] = ("silu",)  # the activations this family may name
    # Layer kinds when config.json has no "layer_types" (configs written by transformers 4).
    legacy_layer_types: LayerTypesFn = _all_sliding_if_windowed
    # Sliding layers only count when this config key is true (SmolLM3, Qwen2); None: always.
    sliding_switch_key: Optional[str] = None


_GELU = ("gelu_pytorch_tanh", "gelu_tanh", "gelu")
_GEMMA2_KEYS = ("hidden_activation", "hidden_act")

SUPPORTED_ARCHITECTURES: dict[str, ArchitectureTraits] = {
    "LlamaForCausalLM": ArchitectureTraits(qkv_bias_key="attention_bias", mlp_bias_key="mlp_bias"),
    "MistralForCausalLM": ArchitectureTraits(qkv_bias_key=None),
    "Qwen2ForCausalLM": ArchitectureTraits(qkv_bias_key=None, fixed_qkv_bias=True, legacy_layer_types=_qwen2_style,
                                           sliding_switch_key="use_sliding_window"),
    "Qwen3ForCausalLM": ArchitectureTraits(qkv_bias_key="attention_bias", qk_norm=True,
                                           legacy_layer_types=_qwen2_style, sliding_switch_key="use_sliding_window"),
    "SmolLM3ForCausalLM": ArchitectureTraits(qkv_bias_key="attention_bias", mlp_bias_key="mlp_bias",
                                             legacy_layer_types=_qwen2_style, sliding_switch_key="use_sliding_window"),
    "GraniteForCausalLM": ArchitectureTraits(qkv_bias_key="attention_bias", mlp_bias_key="mlp_bias"),
    "Olmo2ForCausalLM": ArchitectureTraits(qkv_bias_key="attention_bias", qk_norm=True),
    "Phi3ForCausalLM": ArchitectureTraits(qkv_bias_key=None),
    "PhiForCausalLM": ArchitectureTraits(qkv_bias_key=None, fixed_qkv_bias=True, fixed_o_bias=True,
                                         activations=("gelu_new", "gelu_pytorch_tanh", "gelu")),
    "GemmaForCausalLM": ArchitectureTraits(qkv_bias_key="attention_bias", activations=_GELU),
    "Gemma2ForCausalLM": ArchitectureTraits(qkv_bias_key="attention_bias", activation_keys=_GEMMA2_KEYS,
                                            activations=_GELU, legacy_layer_types=_gemma2_style),
    "Gemma3ForCausalLM": ArchitectureTraits(qkv_bias_key="attention_bias", qk_norm=True,
                                            activation_keys=_GEMMA2_KEYS, activations=_GELU,
                                            legacy_layer_types=_gemma3_style),
    # Mixture-of-Experts (moe_config.py reads their expert settings, moe_models.py runs them).
    "MixtralForCausalLM": ArchitectureTraits(qkv_bias_key=None),
    "Qwen2MoeForCausalLM": ArchitectureTraits(qkv_bias_key=None, fixed_qkv_bias=True,
                                              legacy_layer_types=_qwen2_style, sliding_switch_key="use_sliding_window"),
    "Qwen3MoeForCausalLM": ArchitectureTraits(qkv_bias_key="attention_bias", qk_norm=True,
                                              sliding_switch_key="use_sliding_window"),
}


def layer_types(hf_config: Mapping[str, Any], traits: ArchitectureTraits, num_layers: int) -> tuple[str, ...]:
    """Each layer's attention kind, FULL or SLIDING, as transformers decides it for this config."""
    if traits.sliding_switch_key is not None and not hf_config.get(traits.sliding_switch_key):
        return (FULL,) * num_layers
    if hf_config.get("sliding_window") is None:
        return (FULL,) * num_layers
    kinds = hf_config.get("layer_types") or traits.legacy_layer_types(hf_config, num_layers)
    if len(kinds) != num_layers:
        raise ValueError(f"layer_types has {len(kinds)} entries for {num_layers} layers")
    unknown = sorted(set(kinds) - {FULL, SLIDING})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported (only {FULL!r} and {SLIDING!r})")
    return tuple(kinds)
