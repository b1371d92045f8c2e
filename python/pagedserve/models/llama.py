"""The Llama family: Llama 2/3, TinyLlama, SmolLM2/3, Mistral, Qwen2 and Qwen3.

All of them are the generic decoder (decoder.py) unchanged: pre-norm RMSNorm, SiLU
gated MLP, q/k/v and gate/up merged from separate checkpoint tensors. What differs is
read from config.json into ModelConfig: q/k/v (and o) biases, Qwen3's per-head q/k
RMSNorm, sliding-window layers (Mistral, Qwen2), SmolLM3's layers without rope.
"""

from __future__ import annotations

from pagedserve.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama, TinyLlama, SmolLM2."""


class MistralForCausalLM(DecoderForCausalLM):
    """Llama with sliding-window attention in every layer (when sliding_window is set)."""


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Llama with q/k/v biases; layers from max_window_layers on may slide."""


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Llama with per-head RMSNorm on q and k before rope."""


class SmolLM3ForCausalLM(DecoderForCausalLM):
    """Llama where every no_rope_layer_interval-th layer (no_rope_layers[i] == 0) has no rope."""
