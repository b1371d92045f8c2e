"""RoPE settings from a HF config.json, in either spelling: transformers 4's rope_theta + rope_scaling,
or transformers 5's rope_parameters."""

from __future__ import annotations

from typing import Any, Mapping, Optional


def parse_rope(hf_config: Mapping[str, Any], max_positions: int) -> tuple[float, Optional[dict[str, Any]]]:
    """Returns (theta, llama3 scaling or None) from either rope spelling."""
    params = dict(hf_config.get("rope_parameters") or {})
    legacy_scaling = hf_config.get("rope_scaling") or {}
    if not params:
        params = dict(legacy_scaling)
    theta = float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = float(params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported (only full rotary)")
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        if "factor" not in params:
            raise ValueError("llama3 rope scaling needs a 'factor'")
        return theta, {
            "rope_type": "llama3",
            "factor": float(params["factor"]),
            "low_freq_factor": float(params.get("low_freq_factor", 1.0)),
            "high_freq_factor": float(params.get("high_freq_factor", 4.0)),
            "original_max_position_embeddings": int(params.get("original_max_position_embeddings", max_positions)),
        }
    raise ValueError(f"rope type {rope_type!r} is not supported; supported: 'default', 'llama3'")
