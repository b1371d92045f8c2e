"""Finding and reading a Hugging Face checkpoint's tensor files: safetensors or PyTorch pickles.

Formats, each single-file or sharded behind an index (``weight_map``):
  safetensors  ``model.safetensors`` / ``model.safetensors.index.json`` (or any ``*.safetensors``)
  pt           ``pytorch_model.bin`` / ``pytorch_model.bin.index.json`` (or any ``*.bin`` / ``*.pt``)
"auto" prefers safetensors when a directory holds both. Safetensors files are read
a tensor at a time with plain reads (safetensors_file.py: a memory map would keep
every page read resident until the end of loading). PyTorch files are read with
``torch.load(weights_only=True, mmap=True)``: no code runs, and tensors stay
memory-mapped until the loader copies them into the model's parameters.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch

from pagedserve.models.safetensors_file import SafetensorsFile

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PT_SINGLE_FILE = "pytorch_model.bin"
PT_INDEX_FILE = "pytorch_model.bin.index.json"
FILE_FORMATS = ("safetensors", "pt")
# Files in a model directory that are not the model's weights, whatever their extension says.
_NOT_WEIGHTS = ("training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth", "scaler.pt")


class MissingTensorError(LookupError):
    """A parameter's tensor is in none of the checkpoint's files."""


def checkpoint_format(model_dir: Path, load_format: str = "auto") -> str:
    """"safetensors" or "pt": the file format ``load_format`` reads from ``model_dir``."""
    if load_format in FILE_FORMATS:
        if not _format_files(Path(model_dir), load_format):
            raise FileNotFoundError(_missing_message(model_dir, load_format))
        return load_format
    for file_format in FILE_FORMATS:
        if _format_files(Path(model_dir), file_format):
            return file_format
    raise FileNotFoundError(_missing_message(model_dir, "auto"))


def checkpoint_files(model_dir: Path, load_format: str = "auto") -> list[Path]:
    """The weight files of a HF model directory (sharded or single), in the format ``load_format`` picks."""
    model_dir = Path(model_dir)
    return _format_files(model_dir, checkpoint_format(model_dir, load_format))


def checkpoint_tensor_names(model_dir: Path, load_format: str = "auto") -> set[str]:
    """Every tensor name a checkpoint holds (an index or the safetensors headers; pickles are opened mmapped)."""
    model_dir = Path(model_dir)
    file_format = checkpoint_format(model_dir, load_format)
    index_path = model_dir / (INDEX_FILE if file_format == "safetensors" else PT_INDEX_FILE)
    if index_path.is_file():
        return set(read_weight_map(index_path))
    with CheckpointReader(_format_files(model_dir, file_format)) as reader:
        return reader.names()


class CheckpointReader:
    """Lazy, name-addressed access to the tensors of a set of safetensors and/or PyTorch files."""

    def __init__(self, files: Sequence[Path]):
        self.files = list(files)
        self._stack = contextlib.ExitStack()
        self._source_by_name: dict[str, object] = {}
        for path in self.files:
            if path.suffix == ".safetensors":
                handle = self._stack.enter_context(SafetensorsFile(path))
                self._source_by_name.update(dict.fromkeys(handle.keys(), handle))
            else:
                self._source_by_name.update(_load_pickled_state_dict(path))

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc_info) -> None:
        self._stack.close()
        self._source_by_name.clear()

    def names(self) -> set[str]:
        return set(self._source_by_name)

    def __contains__(self, name: str) -> bool:
        return name in self._source_by_name

    def first_present(self, names: Iterable[str]) -> Optional[str]:
        return next((name for name in names if name in self._source_by_name), None)

    def get(self, name: str, needed_for: str, part=None) -> torch.Tensor:
        """The tensor, or only `part` of it (a parallel_layers.Part: a tensor-parallel rank's rows or
        columns, read alone from a safetensors file)."""
        source = self._source_by_name.get(name)
        if source is None:
            searched = ", ".join(path.name for path in self.files)
            raise MissingTensorError(f"checkpoint is missing tensor {name!r} (needed for parameter {needed_for!r}); "
                                     f"searched: {searched} in {str(self.files[0].parent)!r}")
        if part is None:
            return source if isinstance(source, torch.Tensor) else source.get_tensor(name)  # type: ignore
        shape = list(source.shape) if isinstance(source, torch.Tensor) else source.shape(name)  # type: ignore
        if len(shape) <= part.dim or shape[part.dim] != part.full:
            raise ValueError(f"checkpoint tensor {name!r} has shape {shape}, expected {part.full} along dimension "
                             f"{part.dim} (does config.json match the weights?)")
        if isinstance(source, torch.Tensor):
            return source[(slice(None),) * part.dim + (slice(part.start, part.start + part.length),)]
        return source.get_part(name, part.dim, part.start, part.length)  # type: ignore


def read_weight_map(index_path: Path) -> dict[str, str]:
    index = json.loads(Path(index_path).read_text())
    weight_map: Optional[dict[str, str]] = index.get("weight_map")
    if not weight_map:
        raise ValueError(f"{str(index_path)!r} has no weight_map")
    return weight_map


def _format_files(model_dir: Path, file_format: str) -> list[Path]:
    """The files of one format, [] when the directory has none: the index's shards, the single file, or a glob."""
    index_name, single_name = (INDEX_FILE, SINGLE_FILE) if file_format == "safetensors" else (PT_INDEX_FILE,
                                                                                              PT_SINGLE_FILE)
    index_path = model_dir / index_name
    if index_path.is_file():
        files = [model_dir / name for name in sorted(set(read_weight_map(index_path).values()))]
        missing = [path.name for path in files if not path.is_file()]
        if missing:
            raise FileNotFoundError(f"{index_name} in {str(model_dir)!r} names shards that are not there: "
                                    f"{', '.join(missing)}")
        return files
    if (model_dir / single_name).is_file():
        return [model_dir / single_name]
    patterns = ("*.safetensors",) if file_format == "safetensors" else ("*.bin", "*.pt")
    return sorted(path for pattern in patterns for path in model_dir.glob(pattern)
                  if path.is_file() and path.name not in _NOT_WEIGHTS)


def _missing_message(model_dir: Path, load_format: str) -> str:
    wanted = {"safetensors": f"{SINGLE_FILE} or {INDEX_FILE}",
              "pt": f"{PT_SINGLE_FILE}, {PT_INDEX_FILE} or *.pt"}
    shown = wanted.get(load_format) or f"{wanted['safetensors']}, {wanted['pt']}"
    return f"no {shown} in {str(model_dir)!r} (load_format {load_format!r})"


def _load_pickled_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A PyTorch checkpoint's tensors, memory-mapped when the file allows it (the zip format of torch >= 1.6)."""
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as error:
        if "mmap" not in str(error) and "zip" not in str(error):
            raise
        state = torch.load(str(path), map_location="cpu", weights_only=True)  # legacy format: read into memory
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"{str(path)!r} does not hold a state dict (found {type(state).__name__})")
    return {name: tensor for name, tensor in state.items() if isinstance(tensor, torch.Tensor)}


__all__ = ["CheckpointReader", "FILE_FORMATS", "MissingTensorError", "checkpoint_files", "checkpoint_format",
           "checkpoint_tensor_names", "read_weight_map"]
