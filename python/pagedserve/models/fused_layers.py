"""Every decoder layer of a step as one call into C++ (cpp/ops/decoder_layer.h), on the CPU.

The per-op path runs a Llama layer as about eleven op calls, each converting its
tensors to DLPack; a 30-layer model's decode step makes some 330 of them, about 3 ms
of a 14 ms step on a 2-core CPU. ``fuse_decoder_layers`` hands the decoder's weights
once to a C++ DecoderStack that calls the same ops in the same order, so the hidden
states are bit-identical and a step crosses into C++ once.

It applies to the standard pre-norm layer (Llama, Mistral, Qwen2, Qwen3, SmolLM2/3,
Phi-3: RMSNorm, SiLU-gated MLP, optional q/k/v/o biases, q/k RMSNorm, layers without
rope, sliding windows, one rope table) whose linears all use a kernel the stack knows
(_LINEAR_FORMATS: the bf16 tiles CPU packing makes, a GGUF file's blocks of one type
per linear, its embedding table kept as blocks too, or --quantization int8's channels under
float32 activations). Anything else keeps the per-op
path; the decision is made once, after the weights are packed. Under float32 the o and
down products sum in float64 as the per-op path's do (Linear.float64_sums).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch.utils.dlpack import to_dlpack as _dl

from pagedserve import _core
from pagedserve.models.activations import SiluAndMul
from pagedserve.models.attention_metadata import AttentionMetadata
from pagedserve.models.decoder import Attention, DecoderLayer, DecoderModel
from pagedserve.models.mlp import MLP
from pagedserve.models.layers import Embedding, Linear, PagedAttention, RMSNorm, RotaryEmbedding
from pagedserve.models.gguf_linear import GgufLinear, GgufRows
from pagedserve.models.int8_linear import Int8Linear
from pagedserve.models.linear_kernels import PackedBf16, PackedBf16Activations, PackedBf16Rows

logger = logging.getLogger("pagedserve")

# LinearKernel class -> how the stack multiplies by its weight (exact classes: a subclass may compute
# differently, and then the layer keeps the per-op path).
_LINEAR_FORMATS = {PackedBf16: _core.ops.LinearFormat.packed_bf16,
                   PackedBf16Activations: _core.ops.LinearFormat.packed_bf16_activations,
                   GgufLinear: _core.ops.LinearFormat.gguf,
                   Int8Linear: _core.ops.LinearFormat.int8}


class FusedDecoderStack:
    """model.model's layers as one _core.ops.DecoderStack; called as DecoderModel.forward is."""

    def __init__(self, model: DecoderModel):
        first = model.layers[0].self_attn
        self.hidden_size = model.norm.weight.shape[0]
        self.dtype = model.norm.weight.dtype  # the activations' (the table may be bf16 under float32)
        self.rotary: Optional[RotaryEmbedding] = next(
            (layer.self_attn.rotary for layer in model.layers if layer.self_attn.rotary is not None), None)
        intermediate_size = model.layers[0].mlp.gate_up_proj.out_features // 2
        shape = _core.ops.DecoderShape(self.hidden_size, first.num_heads, first.num_kv_heads, first.head_dim,
                                       intermediate_size, first.qk_norm_per_head)
        rows = model.embed_tokens.lookup  # a tied LM head's tiles (PackedBf16Rows), GGUF blocks, or None: the table
        table, vocab_size, ggml_type = model.embed_tokens.weight, -1, -1
        if isinstance(rows, PackedBf16Rows):
            table, vocab_size = rows.packed, rows.num_rows
        elif isinstance(rows, GgufRows):
            table, ggml_type = rows.blocks, rows.ggml_type
        self.stack = _core.ops.DecoderStack(_dl(table), _dl(model.norm.weight), model.norm.eps, shape, vocab_size,
                                            ggml_type)
        for layer in model.layers:
            self._add_layer(layer)

    def _add_layer(self, layer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        extra = attn.attn.extra
        kernels = [linear.kernel for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        weights = [_weight(kernel) for kernel in kernels]
        self.stack.add_layer(
            input_norm=_dl(layer.input_layernorm.weight), input_eps=layer.input_layernorm.eps,
            qkv=_dl(weights[0]), qkv_bias=_optional(attn.qkv_proj.bias),
            q_norm=_optional(None if attn.q_norm is None else attn.q_norm.weight),
            k_norm=_optional(None if attn.k_norm is None else attn.k_norm.weight),
            qk_eps=0.0 if attn.q_norm is None else attn.q_norm.eps,
            cos_sin=_optional(None if attn.rotary is None else attn.rotary.cos_sin_cache), scale=attn.attn.scale,
            window=int(extra.get("window", 0)), softcap=float(extra.get("softcap", 0.0)),
            o=_dl(weights[1]), o_bias=_optional(attn.o_proj.bias),
            post_attention_norm=_dl(layer.post_attention_layernorm.weight),
            post_attention_eps=layer.post_attention_layernorm.eps,
            gate_up=_dl(weights[2]), gate_up_bias=_optional(mlp.gate_up_proj.bias),
            down=_dl(weights[3]), down_bias=_optional(mlp.down_proj.bias),
            linear_format=_LINEAR_FORMATS[type(kernels[0])],
            ggml_types=[k.one_segment.ggml_type for k in kernels] if isinstance(kernels[0], GgufLinear) else [],
            output_float64_sums=type(kernels[0]) is PackedBf16 and attn.o_proj.float64_sums,
            int8_scales=[_dl(k.weight.scales) for k in kernels] if isinstance(kernels[0], Int8Linear) else [])

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                 kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids [T], positions [T] int32; kv_cache [L, 2, N, Hkv, B, D] -> final hidden states [T, H]."""
        ids = input_ids if input_ids.dtype == torch.int32 else input_ids.to(torch.int32)
        rope_positions = positions if self.rotary is None else self.rotary.table_positions(positions, attn)
        out = torch.empty(ids.shape[0], self.hidden_size, dtype=self.dtype)
        self.stack.forward(_dl(out), _dl(ids), _dl(rope_positions), _dl(attn.slot_mapping), _dl(attn.block_tables),
                           _dl(attn.query_start_loc), _dl(attn.seq_lens), _dl(kv_cache))
        return out


def _weight(kernel) -> torch.Tensor:
    """The tensor the stack multiplies by: bf16 tiles, a GgufLinear's one block matrix, or int8 channels."""
    if isinstance(kernel, GgufLinear):
        return kernel.one_segment.weight
    return kernel.weight.packed if isinstance(kernel, Int8Linear) else kernel.packed


def _optional(tensor: Optional[torch.Tensor]):
    return None if tensor is None else _dl(tensor)


def unfusable_reason(model: DecoderModel) -> Optional[str]:
    """Why model's layers must keep the per-op path, or None when the stack can run them."""
    lookup = model.embed_tokens.lookup
    if lookup is not None and not isinstance(lookup, (PackedBf16Rows, GgufRows)):
        return f"the embedding table is kept as {type(lookup).__name__}"
    if model.norm.weight.device.type != "cpu":
        return "the model is not on the CPU"
    # int8 channels need float32 activations too, and have them: pack_cpu_weights quantizes float32 models only.
    gguf = isinstance(lookup, GgufRows) or any(isinstance(layer.self_attn.qkv_proj.kernel, GgufLinear)
                                               for layer in model.layers)
    if gguf and model.norm.weight.dtype != torch.float32:
        return "GGUF blocks need float32 activations"
    if type(model.embed_tokens) is not Embedding:  # e.g. a vocab-parallel shard, whose lookup all-reduces
        return f"the embedding is a {type(model.embed_tokens).__name__}"
    if model.embed_scale != 1.0:
        return "the embeddings are scaled"
    if not _plain_rms_norm(model.norm):
        return "the final norm is not a plain RMSNorm"
    rotaries = {id(layer.self_attn.rotary) for layer in model.layers if layer.self_attn.rotary is not None}
    if len(rotaries) > 1:
        return "layers use different rope tables"
    for index, layer in enumerate(model.layers):
        reason = _layer_reason(layer)
        if reason is not None:
            return f"layer {index}: {reason}"
    return None


def _layer_reason(layer) -> Optional[str]:
    attn, mlp = layer.self_attn, layer.mlp
    if (type(layer), type(attn), type(attn.attn)) != (DecoderLayer, Attention, PagedAttention):
        return "a subclass of the generic layer, whose forward may differ"
    if layer.placement != "pre" or layer.residual_multiplier != 1.0:
        return f"norm placement {layer.placement!r} with residual multiplier {layer.residual_multiplier}"
    if not (_plain_rms_norm(layer.input_layernorm) and _plain_rms_norm(layer.post_attention_layernorm)):
        return "its norms are not plain RMSNorms"
    if attn.q_norm is not None and not (_plain_rms_norm(attn.q_norm) and _plain_rms_norm(attn.k_norm)
                                        and attn.q_norm.eps == attn.k_norm.eps):
        return "its q/k norms are not plain RMSNorms of one eps"
    if type(mlp) is not MLP or type(mlp.act) is not SiluAndMul:
        return "its MLP is not SiLU-gated"
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if any(type(linear) is not Linear for linear in linears):  # e.g. a row-parallel shard, which all-reduces
        return f"its linears are {sorted({type(linear).__name__ for linear in linears})}, not plain Linears"
    formats = {type(linear.kernel) for linear in linears}
    if len(formats) != 1 or next(iter(formats)) not in _LINEAR_FORMATS:
        names = sorted("float32 weights" if kind is type(None) else kind.__name__ for kind in formats)
        return f"its linears use {', '.join(names)}, not one format the stack runs"
    if any(isinstance(linear.kernel, GgufLinear) and linear.kernel.one_segment is None for linear in linears):
        return "a GGUF linear whose rows mix block types or dense rows"
    if [linear.float64_sums for linear in linears] not in ([False] * 4, [False, True, False, True]):
        return "its linears form float64 sums (Linear.float64_sums) elsewhere than in o and down"
    return None


def _plain_rms_norm(norm) -> bool:
    return type(norm) is RMSNorm and not norm.offset


def fuse_decoder_layers(model) -> bool:
    """Runs model's decoder layers as one DecoderStack from now on when it can; returns whether it does.
    Called once, after the weights are in their final (packed) format."""
    decoder = getattr(model, "model", None)
    if not isinstance(decoder, DecoderModel):
        return False
    reason = unfusable_reason(decoder)
    if reason is not None:
        logger.info("decoder layers keep the per-op path: %s", reason)
        return False
    decoder.use_fused_layers(FusedDecoderStack(decoder))
    logger.info("decoder layers run as one C++ call per step (%d layers)", len(decoder.layers))
    return True


__all__ = ["FusedDecoderStack", "fuse_decoder_layers", "unfusable_reason"]
