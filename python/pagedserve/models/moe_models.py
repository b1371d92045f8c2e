"""The Mixture-of-Experts families: Mixtral, Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) and Qwen3-MoE.

Each is the generic decoder (decoder.py) whose sparse layers' MLP is a
SparseMoeBlock (moe.py), chosen per layer from ModelConfig.moe (moe_config.py):
Mixtral renormalised top-k over all layers; Qwen2-MoE with a sigmoid-gated
shared expert, q/k/v biases and optional dense layers (``mlp_only_layers``,
``decoder_sparse_step``); Qwen3-MoE with Qwen3's per-head q/k RMSNorm.
Module names follow transformers 5 (``mlp.gate``, ``mlp.experts``); Mixtral's
checkpoints name the block ``block_sparse_moe`` and its experts ``w1/w3/w2``.
"""

from __future__ import annotations

from pagedserve import ops
from pagedserve.models.decoder import DecoderForCausalLM


class _MoeDecoder(DecoderForCausalLM):
    @property
    def supports_cuda_graphs(self) -> bool:
        """Capturable only with the device-side grouped GEMM: the per-expert fallback reads the counts on the host."""
        return hasattr(ops, "grouped_linear")


class MixtralForCausalLM(_MoeDecoder):
    """Mistral attention, every MLP a top-k (renormalised) mixture of experts."""

    checkpoint_aliases = {".mlp.": ".block_sparse_moe."}


class Qwen2MoeForCausalLM(_MoeDecoder):
    """Qwen2 attention (q/k/v biases); experts + a sigmoid-gated shared expert."""


class Qwen3MoeForCausalLM(_MoeDecoder):
    """Qwen3 attention (per-head q/k RMSNorm); experts, top-k renormalised when norm_topk_prob."""
