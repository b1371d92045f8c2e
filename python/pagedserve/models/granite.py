"""IBM Granite (3.x dense): Llama with four multipliers, all read into ModelConfig:
embeddings times embedding_multiplier, attention_multiplier as the softmax scale, each
sub-layer's output times residual_multiplier before it joins the residual, and logits
divided by logits_scaling. Checkpoint names are Llama's."""

from __future__ import annotations

from pagedserve.models.decoder import DecoderForCausalLM


class GraniteForCausalLM(DecoderForCausalLM):
    """The generic decoder; ModelConfig's multipliers do the rest."""
