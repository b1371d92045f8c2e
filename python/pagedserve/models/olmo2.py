"""OLMo 2: norms after attention and after the MLP (none before), and q/k RMSNorm over the whole
q and k projections (all heads together) before rope. Checkpoint names are Llama's."""

from __future__ import annotations

from pagedserve.models.decoder import DecoderForCausalLM, DecoderSpec


class Olmo2ForCausalLM(DecoderForCausalLM):
    spec = DecoderSpec(placement="post", qk_norm_per_head=False)
