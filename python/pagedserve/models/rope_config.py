"""RoPE settings from a HF config.json, in either spelling: transformers 4's rope_theta + rope_scaling
(+ Gemma 3's rope_local_base_freq), or transformers 5's rope_parameters (flat, or nested by layer type).

The result is normalised the way transformers' ``standardize_rope_params`` does it, so the table
built from it (pagedserve.models.rope) calls transformers' own rope initialisation functions.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_LEGACY_NAMES = {"su": "longrope"}  # Phi-3's first checkpoints
_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "llama3": ("factor",),
             "longrope": ("short_factor", "long_factor")}
_NOT_SCALING = ("rope_theta", "type", "partial_rotary_factor")


def _layer_params(hf_config: Mapping[str, Any], layer_type: str) -> Optional[dict[str, Any]]:
    """The rope parameter dict for one layer type, or None when the config has none of its own."""
    params = hf_config.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # nested by layer type
        nested = params.get(layer_type)
        return dict(nested) if nested else None
    if layer_type != "full_attention":
        return None
    return dict(params or hf_config.get("rope_scaling") or {})


def parse_rope(hf_config: Mapping[str, Any], max_positions: int) -> tuple[float, Optional[dict[str, Any]]]:
    """Returns (theta, scaling or None) of the global (full attention) layers."""
    params = _layer_params(hf_config, "full_attention") or {}
    return _normalise(params, hf_config, float(hf_config.get("rope_theta") or 10000.0), max_positions)


def parse_sliding_rope(hf_config: Mapping[str, Any],
                       max_positions: int) -> Optional[tuple[float, Optional[dict[str, Any]]]]:
    """Gemma 3: the sliding layers' own rope (another base, no scaling); None when they share the global one."""
    params = _layer_params(hf_config, "sliding_attention")
    if params is not None:
        return _normalise(params, hf_config, float(hf_config.get("rope_theta") or 10000.0), max_positions)
    local_base = hf_config.get("rope_local_base_freq")
    return None if local_base is None else (float(local_base), None)


def partial_rotary_factor(hf_config: Mapping[str, Any]) -> float:
    """The fraction of each head that rope rotates (Phi-4-mini: 0.75)."""
    params = _layer_params(hf_config, "full_attention") or {}
    factor = float(params.get("partial_rotary_factor") or hf_config.get("partial_rotary_factor") or 1.0)
    if not 0.0 < factor <= 1.0:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor}")
    return factor


def _normalise(params: dict[str, Any], hf_config: Mapping[str, Any], default_theta: float,
               max_positions: int) -> tuple[float, Optional[dict[str, Any]]]:
    theta = float(params.get("rope_theta") or default_theta)
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = _LEGACY_NAMES.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: "
                         + ", ".join(repr(t) for t in SUPPORTED_ROPE_TYPES))
    if rope_type == "default":
        return theta, None
    missing = [key for key in _REQUIRED.get(rope_type, ()) if params.get(key) is None]
    if missing:
        raise ValueError(f"{rope_type} rope scaling needs {', '.join(repr(k) for k in missing)}")
    scaling = {key: value for key, value in params.items() if key not in _NOT_SCALING}
    scaling["rope_type"] = rope_type
    if rope_type == "llama3":
        scaling["factor"] = float(scaling["factor"])
        scaling["low_freq_factor"] = float(scaling.get("low_freq_factor", 1.0))
        scaling["high_freq_factor"] = float(scaling.get("high_freq_factor", 4.0))
    if rope_type in ("llama3", "yarn", "longrope"):
        # As transformers: Phi-3's top-level original_max_position_embeddings wins over the rope dict's.
        original = hf_config.get("original_max_position_embeddings") or scaling.get(
            "original_max_position_embeddings") or max_positions
        scaling["original_max_position_embeddings"] = int(original)
    return theta, scaling
