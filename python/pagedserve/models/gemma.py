"""The Gemma family: Gemma 1, Gemma 2 and Gemma 3 (text).

All: RMSNorm scaling by (1 + weight), GeGLU (tanh-approximated gelu) MLP, embeddings
times sqrt(hidden_size) (rounded to the model dtype), tied LM head.
Gemma 2 adds norms after attention and MLP too ("sandwich"), attention scale
query_pre_attn_scalar ** -0.5, attention and final logit soft-capping, and alternating
sliding-window / global layers. Gemma 3 adds per-head q/k norms and gives the sliding
layers their own rope base (rope_local_base_freq), the global layers theirs (with scaling).
Checkpoint names are Llama's.
"""

from __future__ import annotations

from pagedserve.models.decoder import DecoderForCausalLM, DecoderSpec


class GemmaForCausalLM(DecoderForCausalLM):
    spec = DecoderSpec(norm_offset=1.0, embed_scale_sqrt_hidden=True)


class Gemma2ForCausalLM(DecoderForCausalLM):
    spec = DecoderSpec(norm_offset=1.0, embed_scale_sqrt_hidden=True, placement="sandwich")


class Gemma3ForCausalLM(DecoderForCausalLM):
    spec = DecoderSpec(norm_offset=1.0, embed_scale_sqrt_hidden=True, placement="sandwich")
