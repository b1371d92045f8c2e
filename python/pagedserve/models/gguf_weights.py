"""Filling a model from a GGUF file: quantized tensors kept as blocks, dense ones copied.

Our parameters carry Hugging Face names; llama.cpp's converter renamed them
(``model.layers.3.self_attn.q_proj`` -> ``blk.3.attn_q``) and, for the llama
architecture, interleaved the two rope halves of every q and k head (HF row
h D + s D/2 + j is GGUF row h D + 2 j + s). Rows are whole blocks, so undoing
that is a row permutation of the block bytes: nothing is dequantized.

On the CPU a quantized linear becomes a ``GgufLinear`` kernel over its blocks
(the layer's float weight is dropped), a quantized embedding a ``GgufRows``
lookup, and a tied LM head the same blocks through ``GgufLinear``; the
blocks are first interleaved eight rows at a time where the CPU has
the kernels for that layout (``Segment.interleaved``; still no dequantizing). On other
devices quantized tensors are dequantized (gguf.quants) into the dense
parameters. F32/F16/BF16 tensors (norms, biases, small models' matrices) are
copied into the parameters as any checkpoint's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from pagedserve.models.gguf_file import GgufFile, GgufTensor
from pagedserve.models.gguf_linear import GgufLinear, GgufRows, Segment
from pagedserve.models.layers import Embedding, Linear

_TOP_LEVEL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER_PARTS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_ROPE_PERMUTED = {"llama": ("self_attn.q_proj", "self_attn.k_proj")}  # llama.cpp's convert_hf_to_gguf


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name for an HF parameter name: model.layers.3.mlp.up_proj.weight -> blk.3.ffn_up.weight."""
    module, _, leaf = hf_name.rpartition(".")
    if module in _TOP_LEVEL:
        return f"{_TOP_LEVEL[module]}.{leaf}"
    match = _LAYER.match(module)
    if match is None or match.group(2) not in _LAYER_PARTS:
        raise ValueError(f"parameter {hf_name!r} has no GGUF counterpart pagedserve knows")
    return f"blk.{match.group(1)}.{_LAYER_PARTS[match.group(2)]}.{leaf}"


def unpermute_rope_rows(rows: int, head_dim: int) -> torch.Tensor:
    """Row order that turns llama.cpp's interleaved q/k rows back into HF's halves."""
    heads, half = rows // head_dim, head_dim // 2
    h, s, j = torch.meshgrid(torch.arange(heads), torch.arange(2), torch.arange(half), indexing="ij")
    return (h * head_dim + 2 * j + s).reshape(-1)


class GgufLoader:
    def __init__(self, model: nn.Module, gguf: GgufFile):
        self.model = model
        self.gguf = gguf
        self.config = model.config
        self.on_cpu = next(model.parameters()).device.type == "cpu"
        self.packed = dict(getattr(model, "packed_modules", {}))
        self.used: set[str] = set()

    # ------------------------------------------------------------ tensors
    def tensor(self, hf_name: str, rows: Optional[int], cols: Optional[int]) -> GgufTensor:
        name = gguf_tensor_name(hf_name)
        tensor = self.gguf.tensors.get(name)
        if tensor is None:
            raise ValueError(f"{self.gguf.path.name} has no tensor {name!r} (for {hf_name!r}); is it a complete "
                             f"{self.gguf.architecture} model?")
        self.used.add(name)
        shape = _logical_shape(tensor)
        expected = tuple(n for n in (rows, cols) if n is not None)
        if shape != expected:
            raise ValueError(f"GGUF tensor {name!r} has shape {list(shape)}, the model config expects "
                             f"{list(expected)}")
        return tensor

    def segment(self, hf_name: str, rows: int, cols: int, interleave: bool = True) -> Segment:
        """The tensor's rows; quantized ones on the CPU interleaved for the products (``interleave``)."""
        tensor = self.tensor(hf_name, rows, cols)
        weight = tensor.blocks() if tensor.quantized else tensor.dense()
        module = hf_name.rpartition(".")[0]
        if module.split(".", 3)[-1] in _ROPE_PERMUTED.get(self.gguf.architecture, ()):
            weight = weight[unpermute_rope_rows(rows, self.config.head_dim)]
        segment = Segment(weight.contiguous(), tensor.ggml_type if tensor.quantized else None)
        return segment.interleaved() if self.on_cpu and interleave else segment

    def dense(self, segment: Segment) -> torch.Tensor:
        if segment.ggml_type is None:
            return segment.weight
        from gguf import quants

        return torch.from_numpy(quants.dequantize(segment.weight.numpy(), segment.ggml_type))

    # ------------------------------------------------------------ modules
    def load(self) -> None:
        for path, module in self.model.named_modules():
            if isinstance(module, Linear):
                self.load_linear(path, module)
            elif isinstance(module, Embedding):
                self.load_embedding(path, module)
            else:
                for leaf, param in module.named_parameters(recurse=False):
                    name = f"{path}.{leaf}"
                    param.data.copy_(self.tensor(name, *_rows_cols(param)).dense())
        if self.model.lm_head is None:
            self.tie_lm_head()
        self.reject_leftovers()

    def sources(self, path: str) -> list[str]:
        parent, _, name = path.rpartition(".")
        parts = self.packed.get(name)
        return [f"{parent}.{part}" if parent else part for part in parts] if parts else [path]

    def load_linear(self, path: str, linear: Linear) -> None:
        in_features = linear.weight.shape[1]
        names = self.sources(path)
        segments = [self.segment(f"{name}.weight", rows, in_features)
                    for name, rows in zip(names, linear.output_sizes)]
        if linear.bias is not None:
            linear.bias.data.copy_(torch.cat([self.segment(f"{name}.bias", rows, None).weight
                                              for name, rows in zip(names, linear.output_sizes)]))
        quantized = any(segment.ggml_type is not None for segment in segments)
        if quantized and self.on_cpu:
            kernel = GgufLinear(segments)
            if linear is self.model.lm_head:
                self.model.use_lm_head_kernel(kernel)
            else:
                linear.use_kernel(kernel)
            return
        linear.weight.data.copy_(torch.cat([self.dense(segment) for segment in segments]))

    def load_embedding(self, path: str, embedding: Embedding) -> None:
        vocab, dim = embedding.weight.shape
        # A table only looked up keeps the file's layout; a tied one is the LM head's product too.
        segment = self.segment(f"{path}.weight", vocab, dim, interleave=self.model.lm_head is None)
        self.embedding = segment
        if segment.ggml_type is not None and self.on_cpu:
            embedding.use_lookup(GgufRows(segment.weight, segment.ggml_type, dim, self.config.dtype))
        else:
            embedding.weight.data.copy_(self.dense(segment))

    def tie_lm_head(self) -> None:
        """The tied LM head multiplies by the embedding's blocks (shared, not copied)."""
        if self.embedding.ggml_type is not None and self.on_cpu:
            self.model.use_lm_head_kernel(GgufLinear([self.embedding]))

    def reject_leftovers(self) -> None:
        leftovers = sorted(set(self.gguf.tensors) - self.used)
        if leftovers:
            shown = ", ".join(leftovers[:5]) + (f" (+{len(leftovers) - 5} more)" if len(leftovers) > 5 else "")
            raise ValueError(f"{self.gguf.path.name} has tensors the {self.gguf.architecture} model does not use, "
                             f"which indicates an unsupported variant: {shown}")


def _logical_shape(tensor: GgufTensor) -> tuple[int, ...]:
    """[N, K] of a matrix (quantized rows hold K = row_bytes / block_bytes * block_elems), [K] of a vector."""
    if not tensor.quantized:
        return tuple(tensor.data.shape)
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    elems, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.ggml_type)]
    rows, row_bytes = tensor.data.shape
    return (rows, row_bytes // nbytes * elems)


def _rows_cols(param: torch.Tensor) -> tuple[Optional[int], Optional[int]]:
    return (param.shape[0], param.shape[1]) if param.dim() == 2 else (param.shape[0], None)


def load_gguf_weights(model: nn.Module, gguf_path: Path) -> None:
    """Fills ``model`` from the GGUF file (see the module docstring)."""
    with torch.no_grad():
        GgufLoader(model, GgufFile(gguf_path)).load()


__all__ = ["gguf_tensor_name", "load_gguf_weights", "unpermute_rope_rows"]
