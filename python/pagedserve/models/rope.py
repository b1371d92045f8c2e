"""The rope cos/sin table, built from transformers' own rope initialisation functions.

Every scaled rope type (linear, dynamic, yarn, longrope, llama3) takes its inverse
frequencies and attention factor from ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``
(called with a minimal stand-in for the HF config), so the table is transformers' to
the bit: ``cos = cos(position * inv_freq) * attention_factor``, ``sin`` likewise, in
float32. ``ops.rotary_embedding`` then applies it to the first ``rotary_dim`` dims
of each head (partial rotary), half-rotation (NeoX) style as transformers does.

Length-dependent types, and how they compare with transformers:
  dynamic   transformers recomputes the frequencies only once a forward's positions
            exceed max_position_embeddings; the engine never goes beyond it, so the
            frequencies at init (the default ones, scaled by nothing) are exact.
  longrope  transformers uses short_factor while a forward's total length
            (max position + 1) is <= original_max_position_embeddings, long_factor
            for every position once it is longer. The table holds both (short rows,
            then long rows) and a token takes the long rows when max(its prompt's
            length, its position + 1) exceeds the limit (see RotaryEmbedding): one
            forward over a prompt, then one per decoded token, as transformers'
            cached forward; it holds however the prompt is chunked, recomputed after
            preemption or partly served by the prefix cache (whose hashes are salted
            by the side of the limit a prompt is on, ModelConfig.prefix_cache_salt).
            Phi-3's generate() (Phi3ForCausalLM.prepare_inputs_for_generation) goes
            further: the step a sequence first exceeds the limit, it drops its cache
            and recomputes every position with the long factors. We keep the cached
            (short) keys, as its cached forward does, so after that step Phi-3 logits
            differ from its generate() (about 5e-2 in logprob on the tiny test model)
            and equal its forward's (tests_py/test_model_families.py).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Mapping, Optional

import torch


def inverse_frequencies(rotary_dim: int, theta: float, scaling: Optional[Mapping[str, Any]], head_dim: int,
                        max_positions: int, long: bool = False) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2] float32, attention factor), as transformers computes them."""
    if scaling is None:  # transformers' compute_default_rope_parameters, step by step
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(dtype=torch.float) / rotary_dim
        return 1.0 / (theta ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {**scaling, "rope_theta": theta, "partial_rotary_factor": rotary_dim / head_dim}
    stand_in = SimpleNamespace(rope_parameters=params, head_dim=head_dim, hidden_size=head_dim, num_attention_heads=1,
                               max_position_embeddings=max_positions, standardize_rope_params=lambda: None)
    seq_len = int(scaling["original_max_position_embeddings"]) + 1 if long else None
    inv_freq, factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](stand_in, "cpu", seq_len=seq_len)
    return inv_freq.to(torch.float32), float(factor)


def cos_sin_table(num_positions: int, inv_freq: torch.Tensor, attention_factor: float) -> torch.Tensor:
    """[num_positions, rotary_dim] float32 rows [cos | sin] of each position's angles, as transformers rounds them."""
    angles = torch.arange(num_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return torch.cat((cos, sin), dim=-1).contiguous()


def rope_table(max_positions: int, rotary_dim: int, theta: float, scaling: Optional[Mapping[str, Any]],
               head_dim: int) -> torch.Tensor:
    """The table of one rope: [max_positions, rotary_dim]; for longrope [2 * max_positions, rotary_dim]
    (short-factor rows, then long-factor rows)."""
    inv_freq, factor = inverse_frequencies(rotary_dim, theta, scaling, head_dim, max_positions)
    table = cos_sin_table(max_positions, inv_freq, factor)
    if scaling is not None and scaling["rope_type"] == "longrope":
        long_inv_freq, _ = inverse_frequencies(rotary_dim, theta, scaling, head_dim, max_positions, long=True)
        table = torch.cat((table, cos_sin_table(max_positions, long_inv_freq, factor)))
    return table


def is_long_rope(scaling: Optional[Mapping[str, Any]]) -> bool:
    return scaling is not None and scaling["rope_type"] == "longrope"


__all__ = ["cos_sin_table", "inverse_frequencies", "is_long_rope", "rope_table"]
