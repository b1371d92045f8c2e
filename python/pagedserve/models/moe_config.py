"""The Mixture-of-Experts numbers of a config.json (Mixtral, Qwen2-MoE, Qwen3-MoE), read like transformers 5 does.

Missing keys take transformers' defaults for the family, so a config.json that
leaves one out means what it means to transformers. Which layers are sparse:
Mixtral all; the Qwen MoEs every ``decoder_sparse_step``-th layer not listed in
``mlp_only_layers`` (the others are dense MLPs of ``intermediate_size``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

# Per-expert checkpoint names: (gate, up, down) under ``experts.{e}.``, then ``.weight``.
QWEN_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # of each routed expert
    renormalize: bool  # top-k weights divided by their sum (Mixtral always; Qwen: norm_topk_prob)
    shared_expert_intermediate_size: int  # Qwen2-MoE's sigmoid-gated shared expert; 0: none
    sparse_layers: tuple[bool, ...]  # per layer: MoE block (True) or dense MLP
    expert_names: tuple[str, str, str]  # per-expert checkpoint names of (gate, up, down)

    def is_sparse(self, layer: int) -> bool:
        return self.sparse_layers[layer]


# transformers 5.23's config defaults, per architecture.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "MixtralForCausalLM": dict(num_local_experts=8, num_experts_per_tok=2),
    "Qwen2MoeForCausalLM": dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                                shared_expert_intermediate_size=5632, norm_topk_prob=False, decoder_sparse_step=1),
    "Qwen3MoeForCausalLM": dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                norm_topk_prob=False, decoder_sparse_step=1),
}
MOE_ARCHITECTURES = tuple(_DEFAULTS)


def parse_moe(hf_config: Mapping[str, Any], architecture: str, num_layers: int) -> Optional[MoeConfig]:
    """The MoE settings of an MoE architecture's config, None for a dense architecture."""
    if architecture not in _DEFAULTS:
        return None
    defaults = _DEFAULTS[architecture]

    def get(key: str, *aliases: str) -> Any:
        for name in (key, *aliases):
            if hf_config.get(name) is not None:
                return hf_config[name]
        return defaults.get(key)

    top_k = int(get("num_experts_per_tok"))
    if architecture == "MixtralForCausalLM":
        num_experts = int(get("num_local_experts", "num_experts"))
        intermediate = int(hf_config["intermediate_size"])
        return _checked(MoeConfig(num_experts, top_k, intermediate, True, 0, (True,) * num_layers,
                                  MIXTRAL_EXPERT_NAMES))
    num_experts = int(get("num_experts", "num_local_experts"))
    step = int(get("decoder_sparse_step") or 1)
    dense = set(int(i) for i in (hf_config.get("mlp_only_layers") or ()))
    sparse = tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    shared = int(get("shared_expert_intermediate_size") or 0) if architecture == "Qwen2MoeForCausalLM" else 0
    return _checked(MoeConfig(num_experts, top_k, int(get("moe_intermediate_size")), bool(get("norm_topk_prob")),
                              shared, sparse, QWEN_EXPERT_NAMES))


def _checked(config: MoeConfig) -> MoeConfig:
    if any(config.sparse_layers) and not 0 < config.top_k <= config.num_experts:
        raise ValueError(f"num_experts_per_tok={config.top_k} must be between 1 and the "
                         f"{config.num_experts} experts")
    return config


__all__ = ["MIXTRAL_EXPERT_NAMES", "MOE_ARCHITECTURES", "MoeConfig", "QWEN_EXPERT_NAMES", "parse_moe"]
