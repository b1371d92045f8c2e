"""Phi-3, Phi-3.5 and Phi-4-mini: Llama whose checkpoints store q/k/v fused as ``qkv_proj`` and
gate/up fused as ``gate_up_proj`` (gate rows first), which are exactly our merged parameters, so
nothing is packed at load time. Longrope scaling and partial rotary (Phi-4-mini's
partial_rotary_factor 0.75) come from ModelConfig; a sliding_window applies to every layer.
"""

from __future__ import annotations

from pagedserve.models.decoder import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    packed_modules: dict[str, tuple[str, ...]] = {}  # the checkpoint's qkv_proj / gate_up_proj load as they are
