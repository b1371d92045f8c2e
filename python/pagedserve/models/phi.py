"""Phi-2 (and Phi-1/1.5): LayerNorm with bias, attention and MLP in parallel off one norm
(x += attn(ln(x)) + mlp(ln(x))), an ungated fc1/fc2 MLP (gelu_new) with biases, partial rotary
(partial_rotary_factor 0.4-0.5), biases on q/k/v and the output projection (``dense``), a final
``final_layernorm`` and an LM head with a bias. q_layernorm/k_layernorm (qk_layernorm) are not
supported: such a checkpoint's extra tensors fail the load loudly.
"""

from __future__ import annotations

from pagedserve.models.decoder import DecoderForCausalLM, DecoderSpec


class PhiForCausalLM(DecoderForCausalLM):
    spec = DecoderSpec(placement="parallel", layer_norm=True, dense_mlp=True, lm_head_bias=True)
    packed_modules: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
    checkpoint_aliases = {".self_attn.o_proj.": ".self_attn.dense.", "model.norm.": "model.final_layernorm."}
