"""Reading tensors from a safetensors file with plain reads, one tensor at a time.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian
header length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}}
(offsets relative to the byte after the header) and the tensors' bytes, row-major,
little-endian.

Why not ``safetensors.safe_open``: it memory-maps the file, and every page a
tensor read touches stays in the process's resident set until the file is
closed, so loading a model through it holds the whole checkpoint resident next
to the parameters it fills (SmolLM2-135M: 257 MiB of bf16 on top of 520 MiB of
float32 parameters). Reading each tensor into its own buffer instead bounds the
extra memory by the largest tensor, freed once its parameter holds the values.
A part of a tensor (a tensor-parallel shard) is read alone, row block by row
block.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Optional

import torch

# safetensors dtype names -> torch dtypes (those torch has; others fail with a message naming them).
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_HEADER_LIMIT = 100 << 20  # the format's own limit on the JSON header


class SafetensorsFile:
    """One open .safetensors file: names, shapes and dtypes from its header; tensors read on demand."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd = os.open(str(self.path), os.O_RDONLY)
        try:
            (header_len,) = struct.unpack("<Q", self._read_exact(8, 0))
            if header_len > _HEADER_LIMIT:
                raise ValueError(f"{str(self.path)!r} is not a safetensors file (header of {header_len} bytes)")
            header = json.loads(self._read_exact(header_len, 8))
        except BaseException:
            os.close(self._fd)
            raise
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self._entries: dict[str, dict] = header

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> list[int]:
        return list(self._entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        code = self._entries[name]["dtype"]
        if code not in _DTYPES:
            raise ValueError(f"tensor {name!r} in {str(self.path)!r} has dtype {code}, which torch cannot hold")
        return _DTYPES[code]

    def get_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor, in a buffer of its own."""
        return self.get_part(name, 0, 0, None)

    def get_part(self, name: str, dim: int, start: int, length: Optional[int]) -> torch.Tensor:
        """Indices [start, start + length) of dimension ``dim`` (all of it when length is None), read alone."""
        shape, dtype = self.shape(name), self.dtype(name)
        begin, end = self._entries[name]["data_offsets"]
        item = torch.empty((), dtype=dtype).element_size()
        if end - begin != math.prod(shape) * item:
            raise ValueError(f"tensor {name!r} in {str(self.path)!r} has {end - begin} bytes for shape {shape} "
                             f"of {self._entries[name]['dtype']}")
        if not shape:  # a scalar
            return self._read_into(torch.empty((), dtype=dtype), self._data_start + begin)
        full = shape[dim]
        length = full - start if length is None else length
        outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1:]) * item
        out = torch.empty(shape[:dim] + [length] + shape[dim + 1:], dtype=dtype)
        flat = out.view(-1).view(torch.uint8).view(max(outer, 1), length * inner) if out.numel() else None
        if flat is None:
            return out
        for block in range(outer):  # one read per outer index: the whole tensor in one when dim is 0
            offset = self._data_start + begin + (block * full + start) * inner
            self._read_into(flat[block], offset)
        return out

    def _read_into(self, out: torch.Tensor, offset: int) -> torch.Tensor:
        view = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.dim() else \
            memoryview(out.reshape(1).view(torch.uint8).numpy())
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise ValueError(f"{str(self.path)!r} ends before the tensor at byte {offset} (truncated file?)")
            done += got
        return out

    def _read_exact(self, size: int, offset: int) -> bytes:
        data = os.pread(self._fd, size, offset)
        if len(data) != size:
            raise ValueError(f"{str(self.path)!r} is too short to be a safetensors file")
        return data


__all__ = ["SafetensorsFile"]
