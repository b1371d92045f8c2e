"""Filling a model's parameters: from safetensors checkpoints, or random ("dummy").

Our modules mirror the Hugging Face module tree name for name, except that the
projections sharing an input are merged into one matrix at load time: q/k/v
into ``qkv_proj`` and gate/up into ``gate_up_proj`` (one GEMM instead of three
or two). A model declares these merges in its ``packed_modules`` attribute, and
each merged linear says how many rows each source contributes
(``output_sizes``), so a checkpoint with mismatched shapes fails loudly.

Tensors are read lazily from memory-mapped files and cast/copied straight into
the preallocated parameters on the target device, so peak host memory stays at
about one tensor.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Mapping, Optional, Sequence

import torch
from safetensors import safe_open
from torch import nn

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Checkpoint tensors that carry no information for us (recomputed buffers).
_HARMLESS_SUFFIXES = (".rotary_emb.inv_freq",)
# Suffixes that only exist in quantized checkpoints (GPTQ, AWQ, bitsandbytes, fp8, compressed-tensors).
_QUANTIZED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx", ".weight_scale", ".weight_scale_inv",
                       ".input_scale", ".SCB", ".absmax", ".quant_map", ".weight_packed", ".weight_shape")
_LAYER_TENSOR = re.compile(r"^model\.layers\.\d+\.")

DUMMY_INIT_STD = 0.02  # small enough that activations stay finite through every layer in bf16
LOAD_FORMATS = ("auto", "safetensors", "dummy")


class MissingTensorError(LookupError):
    """A parameter's tensor is in none of the checkpoint's files."""


def load_weights(model: nn.Module, model_dir: Optional[Path], load_format: str = "auto", seed: int = 0) -> None:
    """Fills ``model``'s parameters: "auto"/"safetensors" from ``model_dir``, "dummy" with seeded random values."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported; use one of {', '.join(LOAD_FORMATS)}")
    with torch.no_grad():
        if load_format == "dummy":
            init_dummy_weights(model, seed)
            return
        if model_dir is None:
            raise ValueError(f"load_format {load_format!r} needs a model directory (the config has none)")
        load_safetensors_weights(model, Path(model_dir))


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a HF model directory (sharded or single)."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        weight_map = _read_weight_map(index_path)
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {str(model_dir)!r} "
                            "(only safetensors checkpoints are supported)")


def checkpoint_tensor_names(model_dir: Path) -> set[str]:
    """Every tensor name a checkpoint holds, without reading tensor data."""
    index_path = Path(model_dir) / INDEX_FILE
    if index_path.is_file():
        return set(_read_weight_map(index_path))
    names: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            names.update(handle.keys())
    return names


class CheckpointReader:
    """Lazy, name-addressed access to the tensors of a set of safetensors files."""

    def __init__(self, files: Sequence[Path]):
        self.files = list(files)
        self._stack = contextlib.ExitStack()
        self._handle_by_name: dict[str, object] = {}
        for path in self.files:
            handle = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            for name in handle.keys():
                self._handle_by_name[name] = handle

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc_info) -> None:
        self._stack.close()

    def names(self) -> set[str]:
        return set(self._handle_by_name)

    def get(self, name: str, needed_for: str) -> torch.Tensor:
        handle = self._handle_by_name.get(name)
        if handle is None:
            searched = ", ".join(path.name for path in self.files)
            raise MissingTensorError(f"checkpoint is missing tensor {name!r} (needed for parameter {needed_for!r}); "
                           f"searched: {searched} in {str(self.files[0].parent)!r}")
        return handle.get_tensor(name)  # type: ignore[attr-defined]


def load_safetensors_weights(model: nn.Module, model_dir: Path) -> None:
    """Copies every parameter of ``model`` from the checkpoint in ``model_dir``."""
    packed = dict(getattr(model, "packed_modules", {}))
    with CheckpointReader(checkpoint_files(model_dir)) as reader:
        used: set[str] = set()
        for param_name, param in model.named_parameters():
            used.update(_load_parameter(model, param_name, param, packed, reader))
        _reject_unsupported_leftovers(reader.names() - used, type(model).__name__)


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights, the same for the same seed on the same device: norm weights 1, the rest N(0, 0.02^2)."""
    generators: dict[torch.device, torch.Generator] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if _is_norm(module):
                param.data.fill_(1.0)
                continue
            if param.device not in generators:
                generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            param.data.normal_(0.0, DUMMY_INIT_STD, generator=generators[param.device])


def _is_norm(module: nn.Module) -> bool:
    return getattr(module, "is_norm", False)


def _load_parameter(model: nn.Module, param_name: str, param: torch.Tensor, packed: Mapping[str, Sequence[str]],
                    reader: CheckpointReader) -> list[str]:
    """Fills one parameter; returns the checkpoint names it consumed."""
    module_path, _, leaf = param_name.rpartition(".")
    parent_path, _, module_name = module_path.rpartition(".")
    sources = packed.get(module_name)
    if sources is None:
        tensor = reader.get(param_name, param_name)
        _require_shape(param_name, tensor, tuple(param.shape))
        param.data.copy_(tensor)
        return [param_name]
    prefix = f"{parent_path}." if parent_path else ""
    names = [f"{prefix}{source}.{leaf}" for source in sources]
    output_sizes = _output_sizes(model, module_path, len(names))
    row = 0
    for name, rows in zip(names, output_sizes):
        tensor = reader.get(name, param_name)
        _require_shape(name, tensor, (rows, *param.shape[1:]))
        param.data[row:row + rows].copy_(tensor)
        row += rows
    if row != param.shape[0]:
        raise ValueError(f"parameter {param_name!r} has {param.shape[0]} rows but its sources give {row}")
    return names


def _output_sizes(model: nn.Module, module_path: str, num_sources: int) -> tuple[int, ...]:
    sizes = tuple(getattr(model.get_submodule(module_path), "output_sizes", ()))
    if len(sizes) != num_sources:
        raise ValueError(f"module {module_path!r} is packed from {num_sources} tensors but declares "
                         f"output_sizes {sizes}")
    return sizes


def _require_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"checkpoint tensor {name!r} has shape {list(tensor.shape)}, expected {list(expected)} "
                         "(does config.json match the weights?)")


def _reject_unsupported_leftovers(leftovers: set[str], model_name: str) -> None:
    """Extra tensors are ignored unless they would change the computation (quantization, unknown layer parts)."""
    suspicious = sorted(name for name in leftovers if _indicates_unsupported_feature(name))
    if suspicious:
        shown = ", ".join(suspicious[:5]) + (f" (+{len(suspicious) - 5} more)" if len(suspicious) > 5 else "")
        raise ValueError(f"checkpoint has tensors {model_name} does not use, which indicates an unsupported "
                         f"feature (quantization, or biases/norms/experts the config does not declare): {shown}")


def _indicates_unsupported_feature(name: str) -> bool:
    if name.endswith(_HARMLESS_SUFFIXES):
        return False
    return name.endswith(_QUANTIZED_SUFFIXES) or bool(_LAYER_TENSOR.match(name))


def _read_weight_map(index_path: Path) -> dict[str, str]:
    index = json.loads(index_path.read_text())
    weight_map: Optional[dict[str, str]] = index.get("weight_map")
    if not weight_map:
        raise ValueError(f"{str(index_path)!r} has no weight_map")
    return weight_map
