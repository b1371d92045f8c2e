"""The Llama decoder family: Llama 2/3, TinyLlama, SmolLM2, Mistral (full attention), Qwen2 and Qwen3.

One implementation; the architectures differ only in flags carried by
ModelConfig: q/k/v (and o) biases, Qwen3's per-head RMSNorm on q and k before
rope, tied embeddings. The forward takes a flat batch of T tokens from any
mix of sequences (prefill chunks and decodes) and keeps all per-step shape
information in AttentionMetadata, so it has no Python branches on tensor values.

The residual stream follows the fused-add pattern: each norm also adds the
previous sub-layer's output into the residual in the same pass.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve import ops
from pagedserve.models.attention_metadata import AttentionMetadata
from pagedserve.models.model_config import ModelConfig
from pagedserve.models.layers import (Embedding, Linear, PagedAttention, RMSNorm, RotaryEmbedding,
                                      SiluAndMul)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.qkv_proj = Linear(config.hidden_size, (self.q_size, self.kv_size, self.kv_size), config.qkv_bias,
                               dtype, device)
        self.o_proj = Linear(self.q_size, (config.hidden_size,), config.o_bias, dtype, device)
        self.q_norm: Optional[RMSNorm] = None
        self.k_norm: Optional[RMSNorm] = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)
        self.rotary = rotary  # shared by all layers: one cos/sin table
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, layer_kv_cache: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        query = self._heads(q, self.num_heads, self.q_norm)
        key = self._heads(k, self.num_kv_heads, self.k_norm)
        value = v.contiguous().view(num_tokens, self.num_kv_heads, self.head_dim)
        self.rotary(positions, query, key)
        out = self.attn(query, key, value, layer_kv_cache, attn)
        return self.o_proj(out.view(num_tokens, self.q_size))

    def _heads(self, x: torch.Tensor, num_heads: int, norm: Optional[RMSNorm]) -> torch.Tensor:
        """A contiguous [T, heads, D] copy of a column slice of qkv, per-head normalised when the model says so."""
        per_head = x.contiguous().view(-1, self.head_dim)
        if norm is not None:
            per_head = norm(per_head)
        return per_head.view(x.shape[0], num_heads, self.head_dim)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, (size, size), config.mlp_bias, dtype, device)
        self.down_proj = Linear(size, (config.hidden_size,), config.mlp_bias, dtype, device)
        self.act = SiluAndMul()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(hidden)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, dtype, device)
        self.mlp = LlamaMLP(config, dtype, device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                layer_kv_cache: torch.Tensor, attn: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before adding it)."""
        if residual is None:  # first layer: the embeddings are the residual
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(positions, hidden, layer_kv_cache, attn)
        hidden = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                      config.rope_scaling, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.rotary, dtype, device) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual: Optional[torch.Tensor] = None
        for index, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, kv_cache[index], attn)
        assert residual is not None  # there is at least one layer
        return self.norm.add_and_norm(hidden, residual)


class LlamaForCausalLM(nn.Module):
    """The runner's entry point: forward -> final hidden states, compute_logits -> logits."""

    # Checkpoint tensors merged into one parameter at load time (see pagedserve.models.weights).
    packed_modules = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    def __init__(self, config: ModelConfig, device: Optional[torch.device] = None):
        super().__init__()
        self.config = config
        device = torch.device(device) if device is not None else config.device
        self.model = LlamaModel(config, config.dtype, device)
        self.lm_head: Optional[Linear] = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, (config.vocab_size,), False, config.dtype, device)
        self.packed_lm_head: Optional[torch.Tensor] = None  # bf16 tiles of lm_head_weight() (CPU packing)

    def lm_head_weight(self) -> torch.Tensor:
        """The [vocab, hidden] matrix of the logits: the embeddings when they are tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_lm_head(self) -> None:
        """Computes logits from bf16 tiles (the embedding table stays as it is for lookups)."""
        self.packed_lm_head = ops.pack_linear_weight(self.lm_head_weight())
        if self.lm_head is not None:
            self.lm_head.weight = None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [layers, 2, blocks, kv heads, block size, D] -> hidden [T, H]."""
        if kv_cache.shape[0] != self.config.num_layers:
            raise ValueError(f"kv_cache has {kv_cache.shape[0]} layers, the model {self.config.num_layers}")
        return self.model(input_ids, positions.to(torch.int32), attn, kv_cache)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] -> logits [R, vocab] in the model's dtype (the sampler upcasts if it must)."""
        if self.packed_lm_head is not None:
            logits = torch.empty(hidden.shape[0], self.config.vocab_size, dtype=hidden.dtype)
            ops.packed_linear(logits, hidden, self.packed_lm_head)
            return logits
        return F.linear(hidden, self.lm_head_weight())
