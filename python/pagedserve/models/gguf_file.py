"""Reading a GGUF file (llama.cpp's format) with the ``gguf`` package: its architecture, metadata and tensors.

GGUF names tensors the llama.cpp way (``token_embd``, ``blk.N.attn_q``, ...) and
stores quantized ones as raw ggml blocks: a tensor of ggml shape (K, N) is N rows
of K / block_elems blocks, which ``GGUFReader`` hands out as uint8 [N, row_bytes].
This module checks what pagedserve can run and says so when it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

# GGUF general.architecture -> the HF architecture that runs it.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
DENSE_TYPES = ("F32", "F16", "BF16")
QUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # cpp/ops/gguf_blocks.h
_MAGIC = b"GGUF"


@dataclass(frozen=True)
class GgufTensor:
    name: str
    type_name: str  # "Q4_1", "F32", ...
    ggml_type: int
    data: Any  # numpy: uint8 [N, row_bytes] for quantized types, float [N, K] / [K] otherwise

    @property
    def quantized(self) -> bool:
        return self.type_name in QUANTIZED_TYPES

    def dense(self) -> torch.Tensor:
        """A dense tensor as torch (copied out of the memory map)."""
        if self.type_name == "BF16":  # numpy has no bfloat16: the reader hands out the raw 16-bit words
            return torch.from_numpy(np.array(self.data).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.array(self.data))

    def blocks(self) -> torch.Tensor:
        """The quantized rows as uint8 [N, row_bytes] (copied out of the memory map)."""
        return torch.from_numpy(np.array(self.data, dtype=np.uint8))


class GgufFile:
    """A GGUF file's metadata and tensors, memory-mapped; errors name the file."""

    def __init__(self, path: Path):
        from gguf import GGUFReader

        self.path = Path(path)
        check_is_gguf(self.path)
        try:
            self._reader = GGUFReader(str(self.path))
        except Exception as error:  # the package raises ValueError / struct errors on damaged files
            raise ValueError(f"{str(self.path)!r} could not be read as a GGUF file: {error}") from error
        self.architecture = str(self.value("general.architecture"))
        if self.architecture not in GGUF_ARCHITECTURES:
            raise ValueError(f"GGUF architecture {self.architecture!r} ({self.path.name}) is not supported; "
                             f"supported: {', '.join(GGUF_ARCHITECTURES)}")
        self.tensors = {t.name: GgufTensor(t.name, t.tensor_type.name, int(t.tensor_type), t.data)
                        for t in self._reader.tensors}
        self._check_tensor_types()

    def value(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def arch_value(self, key: str, default: Any = None) -> Any:
        """``<architecture>.<key>``, e.g. arch_value("block_count")."""
        return self.value(f"{self.architecture}.{key}", default)

    def _check_tensor_types(self) -> None:
        for tensor in self.tensors.values():
            if tensor.type_name not in DENSE_TYPES + QUANTIZED_TYPES:
                raise ValueError(f"GGUF tensor {tensor.name!r} in {self.path.name} has type {tensor.type_name}, "
                                 f"which pagedserve does not support; supported: "
                                 f"{', '.join(QUANTIZED_TYPES + DENSE_TYPES)} (requantize the model with "
                                 "llama-quantize to one of them)")


def check_is_gguf(path: Path) -> None:
    if not path.is_file():
        raise ValueError(f"{str(path)!r} does not exist (a .gguf model must be a local file)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != _MAGIC:
        raise ValueError(f"{str(path)!r} is not a GGUF file (it does not start with the bytes 'GGUF')")


def is_gguf_path(model: str) -> bool:
    return str(model).lower().endswith(".gguf")


__all__ = ["DENSE_TYPES", "GGUF_ARCHITECTURES", "QUANTIZED_TYPES", "GgufFile", "GgufTensor", "check_is_gguf",
           "is_gguf_path"]
