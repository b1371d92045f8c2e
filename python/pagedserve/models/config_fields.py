"""Reading the plain fields of a HF config.json (and generation_config.json) for ModelConfig."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from pagedserve.models.families import SUPPORTED_ARCHITECTURES, ArchitectureTraits

DTYPES_BY_NAME: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def architecture(hf_config: Mapping[str, Any]) -> str:
    architectures = hf_config.get("architectures") or []
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    shown = ", ".join(architectures) if architectures else "<none listed>"
    raise ValueError(f"unsupported architecture {shown}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def attention_biases(hf_config: Mapping[str, Any], traits: ArchitectureTraits) -> tuple[bool, bool]:
    if traits.fixed_qkv_bias:
        return True, traits.fixed_o_bias
    enabled = bool(traits.qkv_bias_key and hf_config.get(traits.qkv_bias_key, False))
    return enabled, enabled  # Llama/Qwen3 attention_bias covers q, k, v and o alike


def checkpoint_dtype(hf_config: Mapping[str, Any]) -> torch.dtype:
    name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    name = str(name).removeprefix("torch.")
    if name not in DTYPES_BY_NAME:
        raise ValueError(f"checkpoint dtype {name!r} is not supported; expected float32, bfloat16 or float16")
    return DTYPES_BY_NAME[name]


def tie_word_embeddings(hf_config: Mapping[str, Any], model_dir: Optional[Path]) -> bool:
    """The config decides; when it is silent, a checkpoint without lm_head.weight is tied."""
    if "tie_word_embeddings" in hf_config:
        return bool(hf_config["tie_word_embeddings"])
    if model_dir is None:
        return False
    from pagedserve.models.checkpoint_files import checkpoint_tensor_names

    try:
        return "lm_head.weight" not in checkpoint_tensor_names(model_dir)
    except FileNotFoundError:
        return False


# generation_config.json keys that set a sampling default; greedy files (do_sample false) set temperature 0.
GENERATION_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(generation_config: Mapping[str, Any]) -> dict[str, Any]:
    defaults = {k: generation_config[k] for k in GENERATION_SAMPLING_KEYS if generation_config.get(k) is not None}
    if generation_config.get("do_sample") is False:
        defaults = {"temperature": 0.0}
    return defaults


def eos_token_ids(hf_config: Mapping[str, Any], generation_config: Mapping[str, Any]) -> tuple[int, ...]:
    merged: list[int] = []
    for source in (hf_config.get("eos_token_id"), generation_config.get("eos_token_id")):
        for token in as_int_list(source):
            if token not in merged:
                merged.append(token)
    return tuple(merged)


def bos_token_id(hf_config: Mapping[str, Any], generation_config: Mapping[str, Any]) -> Optional[int]:
    for source in (hf_config.get("bos_token_id"), generation_config.get("bos_token_id")):
        if source is not None:
            return int(source)
    return None


def as_int_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def required_int(hf_config: Mapping[str, Any], key: str) -> int:
    if hf_config.get(key) is None:
        raise ValueError(f"config.json lacks required key {key!r}")
    return int(hf_config[key])


def activation(hf_config: Mapping[str, Any], architecture: str, traits: ArchitectureTraits) -> str:
    """The MLP's activation, by the first of the family's keys the config sets."""
    act = next((hf_config[k] for k in traits.activation_keys if hf_config.get(k)), traits.activations[0])
    if act not in traits.activations:
        raise ValueError(f"hidden_act {act!r} is not supported for {architecture} "
                         f"(supported: {', '.join(traits.activations)})")
    return str(act)


def sliding_window(hf_config: Mapping[str, Any], kinds: tuple[str, ...], max_positions: int) -> int:
    """The window of the sliding layers; 0 when no layer slides or the window spans every position anyway."""
    window = hf_config.get("sliding_window")
    if window is None or "sliding_attention" not in kinds or int(window) >= max_positions:
        return 0
    if int(window) <= 0:
        raise ValueError(f"sliding_window must be positive, got {window}")
    return int(window)


def rope_layers(hf_config: Mapping[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Whether each layer applies rope: SmolLM3's no_rope_layers (1 = rope, 0 = none) or every
    no_rope_layer_interval-th layer without; every layer for other families."""
    flags = hf_config.get("no_rope_layers")
    if flags is None and hf_config.get("no_rope_layer_interval"):
        interval = int(hf_config["no_rope_layer_interval"])
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if flags is None:
        return (True,) * num_layers
    if len(flags) != num_layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {num_layers} layers")
    return tuple(bool(f) for f in flags)


def optional_float(hf_config: Mapping[str, Any], key: str, default: float) -> float:
    value = hf_config.get(key)
    return default if value is None else float(value)
