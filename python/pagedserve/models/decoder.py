"""The generic decoder: attention + gated MLP layers, parameterised by a family's DecoderSpec.

Every dense family is this module plus a few choices (DecoderSpec) and its checkpoint
names (``packed_modules``); the per-model numbers (biases, window, softcap, scales,
multipliers, rope) come from ModelConfig. The forward takes a flat batch of T tokens
from any mix of sequences (prefill chunks and decodes) and keeps all per-step shape
information in AttentionMetadata, so it has no Python branches on tensor values.

The residual stream follows the fused-add pattern: a layer returns (pending, residual)
where the stream is residual + pending, and the next norm adds and normalises in one
pass. Norm placements:
  "pre"       x += attn(norm(x)); x += mlp(norm(x))                        (Llama)
  "sandwich"  x += post_norm(attn(norm(x))); x += post_norm(mlp(norm(x)))  (Gemma 2/3)
  "post"      x += post_norm(attn(x)); x += post_norm(mlp(x))              (OLMo2)
  "parallel"  x += attn(norm(x)) + mlp(norm(x)), one norm                   (Phi-2)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve import ops
from pagedserve.distributed.context import SINGLE, ParallelContext
from pagedserve.models.attention_metadata import AttentionMetadata
from pagedserve.models.families import SLIDING
from pagedserve.models.layers import Embedding, LayerNorm, Linear, PagedAttention, RMSNorm, RotaryEmbedding
from pagedserve.models.linear_kernels import LinearKernel, PackedBf16
from pagedserve.models.model_config import ModelConfig
from pagedserve.models.mlp import MLP, DenseMLP
from pagedserve.models.moe import SparseMoeBlock
from pagedserve.models.parallel_layers import (HeadLayout, attention_output_linear, embedding, heads_norm,
                                               lm_head_linear, qkv_linear)


@dataclass(frozen=True)
class DecoderSpec:
    norm_offset: float = 0.0  # Gemma: norms scale by (1 + weight)
    placement: str = "pre"  # "pre" | "sandwich" | "post"
    qk_norm_per_head: bool = True  # False: OLMo2 normalises q and k over the whole projection
    embed_scale_sqrt_hidden: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    layer_norm: bool = False  # Phi-2: LayerNorm with bias instead of RMSNorm
    dense_mlp: bool = False  # Phi-2: fc2(act(fc1(x))) with biases instead of the gated MLP
    lm_head_bias: bool = False


def make_norm(config: ModelConfig, spec: DecoderSpec, size: int, dtype: torch.dtype,
              device: torch.device) -> nn.Module:
    if spec.layer_norm:
        return LayerNorm(size, config.rms_norm_eps, dtype, device)
    return RMSNorm(size, config.rms_norm_eps, dtype, device, spec.norm_offset)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, spec: DecoderSpec, layer: int, rotary: Optional[RotaryEmbedding],
                 dtype: torch.dtype, device: torch.device, parallel: ParallelContext = SINGLE):
        super().__init__()
        heads = HeadLayout.of(config.num_heads, config.num_kv_heads, parallel)  # this rank's heads
        self.num_heads = heads.num_heads
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = qkv_linear(config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                                   config.qkv_bias, dtype, device, parallel)
        self.o_proj = attention_output_linear(config.num_heads, config.num_kv_heads, config.head_dim,
                                              config.hidden_size, config.o_bias, dtype, device, parallel)
        self.qk_norm_per_head = spec.qk_norm_per_head
        self.q_norm: Optional[nn.Module] = None
        self.k_norm: Optional[nn.Module] = None
        if config.qk_norm and spec.qk_norm_per_head:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device, spec.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device, spec.norm_offset)
        elif config.qk_norm:  # OLMo2: over all heads together, which a tensor-parallel rank holds a slice of
            self.q_norm = heads_norm(config.num_heads, config.num_kv_heads, config.head_dim, False,
                                     config.rms_norm_eps, dtype, device, parallel)
            self.k_norm = heads_norm(config.num_heads, config.num_kv_heads, config.head_dim, True,
                                     config.rms_norm_eps, dtype, device, parallel)
        self.rotary = rotary  # shared by the layers of one rope: one cos/sin table; None: no rope (SmolLM3)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, scale=config.attention_scale,
                                   window=config.layer_window(layer), softcap=config.attn_logit_softcap)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, layer_kv_cache: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        if self._fused_input(hidden, layer_kv_cache):
            query = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=hidden.dtype, device=hidden.device)
            rope_args = (self.rotary.table_positions(positions, attn), self.rotary.cos_sin_cache, layer_kv_cache[0],
                         layer_kv_cache[1], attn.slot_mapping)
            operands = None if self.q_norm is not None else self.qkv_proj.small_batch_operands(hidden)
            if operands is None:
                ops.qkv_rope_cache(query, self.qkv_proj(hidden), *rope_args, *self._head_norms())
            else:  # a decode step of a row or two: the projection too, in the same kernel
                ops.qkv_linear_rope_cache(query, hidden, *operands, *rope_args)
            out = self.attn.attend(query, layer_kv_cache, attn)
            return self.o_proj(out.view(num_tokens, self.q_size))
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        query = self._heads(q, self.num_heads, self.q_norm)
        key = self._heads(k, self.num_kv_heads, self.k_norm)
        value = v.contiguous().view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            self.rotary(self.rotary.table_positions(positions, attn), query, key)
        out = self.attn(query, key, value, layer_kv_cache, attn)
        return self.o_proj(out.view(num_tokens, self.q_size))

    def _fused_input(self, hidden: torch.Tensor, layer_kv_cache: torch.Tensor) -> bool:
        """Whether ops.qkv_rope_cache makes the attention's input from the qkv projection (on a GPU: one kernel
        instead of three copies, rope and the cache write, and the two q/k norms of Qwen3-like models): rope on
        every q and k head, a cache of the model's dtype; q/k norms only per head, with rope over whole heads of
        at most 128 dims (the kernel's limits for summing a head as rms_norm does)."""
        if not (hidden.is_cuda and self.rotary is not None and layer_kv_cache.dtype == hidden.dtype):
            return False
        if self.q_norm is None:
            return True
        return (self.qk_norm_per_head and self.rotary.cos_sin_cache.shape[1] == self.head_dim
                and self.head_dim <= 128 and self.head_dim // 2 * hidden.element_size() % 16 == 0)

    def _head_norms(self) -> tuple:
        """ops.qkv_rope_cache's q_norm, k_norm and eps arguments: none without per-head norms."""
        if self.q_norm is None:
            return ()
        return self.q_norm.scale(), self.k_norm.scale(), self.q_norm.eps

    def _heads(self, x: torch.Tensor, num_heads: int, norm: Optional[RMSNorm]) -> torch.Tensor:
        """A contiguous [T, heads, D] copy of a column slice of qkv, normalised when the model says so."""
        rows = x.contiguous()
        if norm is not None:
            rows = norm(rows.view(-1, self.head_dim) if self.qk_norm_per_head else rows)
        return rows.view(x.shape[0], num_heads, self.head_dim)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, spec: DecoderSpec, layer: int, rotary: Optional[RotaryEmbedding],
                 dtype: torch.dtype, device: torch.device, parallel: ParallelContext = SINGLE):
        super().__init__()
        self.placement = spec.placement
        self.residual_multiplier = config.residual_multiplier
        self.self_attn = Attention(config, spec, layer, rotary, dtype, device, parallel)
        sparse = config.moe is not None and config.moe.is_sparse(layer)
        self.mlp: nn.Module
        if sparse:
            self.mlp = SparseMoeBlock.from_config(config.moe, config.hidden_size, dtype, device, parallel)
        else:
            self.mlp = (DenseMLP if spec.dense_mlp else MLP)(config, dtype, device, parallel)

        def norm() -> nn.Module:
            return make_norm(config, spec, config.hidden_size, dtype, device)

        if spec.placement != "post":
            self.input_layernorm = norm()
        if spec.placement != "parallel":
            self.post_attention_layernorm = norm()
        if spec.placement == "sandwich":
            self.pre_feedforward_layernorm = norm()
        if spec.placement in ("sandwich", "post"):
            self.post_feedforward_layernorm = norm()

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                layer_kv_cache: torch.Tensor, attn: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(pending, residual) in, the same out: the stream is residual + pending (residual None: hidden)."""
        if self.placement == "post":
            return self._post_norm_forward(positions, hidden, residual, layer_kv_cache, attn)
        if self.placement == "parallel":
            stream = hidden if residual is None else residual.add_(hidden)
            normed = self.input_layernorm(stream)
            return self.self_attn(positions, normed, layer_kv_cache, attn) + self.mlp(normed), stream
        if residual is None:  # first layer: the embeddings are the residual
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self._scaled(self.self_attn(positions, hidden, layer_kv_cache, attn))
        if self.placement == "sandwich":
            hidden = self.post_attention_layernorm(hidden)
            hidden = self.pre_feedforward_layernorm.add_and_norm(hidden, residual)
            return self.post_feedforward_layernorm(self.mlp(hidden)), residual
        hidden = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self._scaled(self.mlp(hidden)), residual

    def _post_norm_forward(self, positions, hidden, residual, layer_kv_cache, attn):
        stream = hidden if residual is None else residual.add_(hidden)
        stream = stream + self.post_attention_layernorm(self.self_attn(positions, stream, layer_kv_cache, attn))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.residual_multiplier == 1.0 else x.mul_(self.residual_multiplier)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, spec: DecoderSpec, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelContext = SINGLE):
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size, dtype, device, parallel)
        self.embed_scale = config.embedding_multiplier
        if spec.embed_scale_sqrt_hidden:  # transformers rounds sqrt(hidden) to the model dtype first
            self.embed_scale *= torch.tensor(math.sqrt(config.hidden_size), dtype=dtype).item()

        def rotary(theta: float, scaling: Optional[dict]) -> RotaryEmbedding:
            return RotaryEmbedding(config.rotary_dim, config.head_dim, config.max_position_embeddings, theta,
                                   scaling, device)

        self.rotary = rotary(config.rope_theta, config.rope_scaling)
        self.sliding_rotary = rotary(*config.sliding_rope) if config.sliding_rope is not None else self.rotary
        self.layers = nn.ModuleList(
            DecoderLayer(config, spec, i, self._layer_rotary(config, i), dtype, device, parallel)
            for i in range(config.num_layers))
        self.norm = make_norm(config, spec, config.hidden_size, dtype, device)
        self.fused: Optional[Callable] = None  # all layers in one C++ call (fused_layers.py)

    def use_fused_layers(self, stack: Callable) -> None:
        """Runs every forward through `stack` (fused_layers.FusedDecoderStack: the same ops in one call)."""
        self.fused = stack

    def _layer_rotary(self, config: ModelConfig, layer: int) -> Optional[RotaryEmbedding]:
        if not config.layer_uses_rope(layer):
            return None
        return self.sliding_rotary if config.layer_type(layer) == SLIDING else self.rotary

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused(input_ids, positions, attn, kv_cache)
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale != 1.0:
            hidden = hidden * self.embed_scale
        residual: Optional[torch.Tensor] = None
        for index, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, kv_cache[index], attn)
        assert residual is not None  # there is at least one layer
        return self.norm.add_and_norm(hidden, residual)


class DecoderForCausalLM(nn.Module):
    """The runner's entry point: forward -> final hidden states, compute_logits -> logits.

    A family subclasses it, setting ``spec`` and (when its checkpoint names differ) ``packed_modules``.
    """

    spec = DecoderSpec()
    # Checkpoint tensors merged into one parameter at load time (see pagedserve.models.weights).
    packed_modules: dict[str, tuple[str, ...]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    def __init__(self, config: ModelConfig, device: Optional[torch.device] = None,
                 parallel: ParallelContext = SINGLE):
        """parallel: this rank's place in a tensor-parallel group; the model then holds its shard."""
        super().__init__()
        self.config = config
        self.parallel = parallel
        device = torch.device(device) if device is not None else config.device
        self.model = DecoderModel(config, self.spec, config.dtype, device, parallel)
        self.lm_head: Optional[Linear] = None
        if not config.tie_word_embeddings:
            self.lm_head = lm_head_linear(config.hidden_size, config.vocab_size, self.spec.lm_head_bias, config.dtype,
                                          device, parallel)
        self.lm_head_kernel: Optional[LinearKernel] = None  # lm_head_weight() in a CPU kernel's format

    def lm_head_weight(self) -> torch.Tensor:
        """The [vocab, hidden] matrix of the logits: the embeddings when they are tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def lm_head_bias(self) -> Optional[torch.Tensor]:
        return None if self.lm_head is None else self.lm_head.bias

    def pack_lm_head(self) -> None:
        """Computes logits from bf16 tiles."""
        self.use_lm_head_kernel(PackedBf16(self.lm_head_weight()))

    def use_lm_head_kernel(self, kernel: LinearKernel) -> None:
        """Computes logits through the kernel, which holds its own copy of the weight. A tied embedding table
        then serves lookups only: where it holds only bf16 values (a bf16 checkpoint) they are read from the
        head's bf16 tiles, or, under other kernels, kept as a bf16 table."""
        self.lm_head_kernel = kernel
        if self.lm_head is not None:
            self.lm_head.weight = None
        table = self.model.embed_tokens
        if table.weight is None:
            return
        tied_tiles = self.lm_head is None and isinstance(kernel, PackedBf16) and type(table) is Embedding
        if not (tied_tiles and table.read_from_tiles(kernel.packed)):
            table.keep_bf16_if_exact()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [layers, 2, blocks, kv heads, block size, D] -> hidden [T, H]."""
        if kv_cache.shape[0] != self.config.num_layers:
            raise ValueError(f"kv_cache has {kv_cache.shape[0]} layers, the model {self.config.num_layers}")
        return self.model(input_ids, positions.to(torch.int32), attn, kv_cache)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """hidden [R, H] -> logits [R, vocab] in the model's dtype (the sampler upcasts if it must).
        Tensor-parallel: every rank computes its vocabulary shard and the driver gets them all; the
        other ranks get None (only the driver samples)."""
        if self.lm_head_kernel is not None:
            logits = self.lm_head_kernel(hidden, self.lm_head_bias())
        else:
            # cuBLAS, as transformers: a prompt's first logits stay bit-identical to transformers' on the
            # same GPU (test_gpu_engine.py), and its LM-head kernels already stream at ~90 % of the copy rate.
            logits = F.linear(hidden, self.lm_head_weight(), self.lm_head_bias())
        if self.parallel.is_parallel:
            logits = self.parallel.gather_to_driver(logits)
            if logits is None:
                return None
            logits = logits[:, :self.config.vocab_size]  # the last shard's padding
        if self.config.logits_scaling != 1.0:  # Granite
            logits = logits / self.config.logits_scaling
        if self.config.final_logit_softcap:  # Gemma 2
            cap = self.config.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
