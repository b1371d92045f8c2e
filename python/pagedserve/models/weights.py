"""Filling a model's parameters: from safetensors or PyTorch checkpoints, or random ("dummy").

Our modules mirror the Hugging Face module tree name for name, except that the
projections sharing an input are merged into one matrix at load time: q/k/v
into ``qkv_proj`` and gate/up into ``gate_up_proj`` (one GEMM instead of three
or two). A model declares these merges in its ``packed_modules`` attribute, and
each merged linear says how many rows each source contributes
(``output_sizes``), so a checkpoint with mismatched shapes fails loudly. A model
may also declare ``checkpoint_aliases`` (our name fragment -> the checkpoint's,
e.g. Mixtral's ``.mlp.`` -> ``.block_sparse_moe.``), and a module may fill its own
parameters with a ``load_parameter(leaf, param, module_path, source)`` method
(the MoE experts, stored per expert or as 3D tensors).

Tensors are read one at a time (checkpoint_files.py) and cast/copied straight
into the preallocated parameters on the target device, so the checkpoint adds
about one tensor to peak host memory; any checkpoint dtype (fp32, bf16, fp16)
becomes the engine's dtype in that copy. ``on_module_loaded(model, module)``, when
given, is called as soon as a module's own parameters are all filled, so a CPU
engine can put each linear into its kernel's format (cpu_weight_packing.py:
StreamedPacking) before the next is read: the parameters are allocated
untouched, and only those filled and not yet packed take memory.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import torch
from torch import nn

from pagedserve.models.checkpoint_files import (INDEX_FILE, SINGLE_FILE, CheckpointReader, MissingTensorError,
                                                checkpoint_files, checkpoint_tensor_names)
from pagedserve.models.gguf_model_dir import gguf_source
from pagedserve.models.gguf_weights import load_gguf_weights

# Checkpoint tensors that carry no information for us (recomputed buffers).
_HARMLESS_SUFFIXES = (".rotary_emb.inv_freq",)
# Suffixes that only exist in quantized checkpoints (GPTQ, AWQ, bitsandbytes, fp8, compressed-tensors).
_QUANTIZED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx", ".weight_scale", ".weight_scale_inv",
                       ".input_scale", ".SCB", ".absmax", ".quant_map", ".weight_packed", ".weight_shape")
_LAYER_TENSOR = re.compile(r"^model\.layers\.\d+\.")

DUMMY_INIT_STD = 0.02  # small enough that activations stay finite through every layer in bf16
LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")
# Called with (model, module) once the module's own parameters hold the checkpoint's values.
ModuleLoaded = Callable[[nn.Module, nn.Module], None]


def load_weights(model: nn.Module, model_dir: Optional[Path], load_format: str = "auto", seed: int = 0,
                 on_module_loaded: Optional[ModuleLoaded] = None) -> None:
    """Fills ``model``'s parameters: "auto"/"safetensors"/"pt" from ``model_dir``, "dummy" with seeded random values.

    "auto" reads safetensors when the directory has them, else PyTorch ``.bin``/``.pt`` files.
    on_module_loaded: see the module docstring (checkpoints only; dummy and GGUF weights are filled whole).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported; use one of {', '.join(LOAD_FORMATS)}")
    with torch.no_grad():
        if load_format == "dummy":
            init_dummy_weights(model, seed)
            return
        if model_dir is None:
            raise ValueError(f"load_format {load_format!r} needs a model directory (the config has none)")
        gguf_path = gguf_source(Path(model_dir))
        if gguf_path is not None:  # a .gguf model: its blocks, not a checkpoint (gguf_weights.py)
            load_gguf_weights(model, gguf_path)
            return
        load_checkpoint_weights(model, Path(model_dir), load_format, on_module_loaded)


class TensorSource:
    """The checkpoint as the parameters see it: aliases applied, and every tensor handed out recorded."""

    def __init__(self, reader: CheckpointReader, aliases: Mapping[str, str]):
        self.reader = reader
        self.aliases = dict(aliases)
        self.used: set[str] = set()

    def resolve(self, name: str) -> Optional[str]:
        """The checkpoint's name for our ``name`` (itself or an alias), None when it has neither."""
        candidates = [name] + [name.replace(ours, theirs) for ours, theirs in self.aliases.items() if ours in name]
        return self.reader.first_present(candidates)

    def get(self, name: str, needed_for: str, part=None) -> torch.Tensor:
        """The tensor ``name``, or only ``part`` of it (a tensor-parallel shard, parallel_layers.Part)."""
        actual = self.resolve(name) or name
        tensor = self.reader.get(actual, needed_for, part)  # raises MissingTensorError, naming ``name``
        self.used.add(actual)
        return tensor

    def claim(self, name: str) -> None:
        """Marks ``name`` as this model's without reading it (another tensor-parallel rank's expert)."""
        actual = self.resolve(name)
        if actual is not None:
            self.used.add(actual)


def load_checkpoint_weights(model: nn.Module, model_dir: Path, load_format: str = "auto",
                            on_module_loaded: Optional[ModuleLoaded] = None) -> None:
    """Copies every parameter of ``model`` from the checkpoint in ``model_dir`` (safetensors or PyTorch files)."""
    packed = dict(getattr(model, "packed_modules", {}))
    modules = dict(model.named_modules())
    loading: Optional[str] = None  # the module whose parameters are being filled
    with CheckpointReader(checkpoint_files(model_dir, load_format)) as reader:
        source = TensorSource(reader, getattr(model, "checkpoint_aliases", {}))
        # named_parameters yields each module's own parameters one after another, so a module is complete
        # when the next parameter belongs to another. Names only: the generator's memo of parameters would
        # keep every float32 weight alive after its module has been packed.
        for param_name in [name for name, _ in model.named_parameters()]:
            module_path, _, leaf = param_name.rpartition(".")
            param = getattr(modules[module_path], leaf)
            if on_module_loaded is not None and loading is not None and module_path != loading:
                on_module_loaded(model, modules[loading])
            loading = module_path
            custom = getattr(modules[module_path], "load_parameter", None)
            if custom is not None:
                custom(leaf, param, module_path, source)
            else:
                _load_parameter(model, param_name, param, packed, source, getattr(modules[module_path], "shard", None))
            del param
        if on_module_loaded is not None and loading is not None:
            on_module_loaded(model, modules[loading])
        _reject_unsupported_leftovers(reader.names() - source.used, type(model).__name__)


def load_safetensors_weights(model: nn.Module, model_dir: Path) -> None:
    """Kept for callers of the safetensors-only API."""
    load_checkpoint_weights(model, model_dir, "safetensors")


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
                    source: TensorSource, shard=None) -> None:
    """Fills one parameter (a merged one from its row blocks). ``shard`` (parallel_layers.LinearShard, None for
    a whole parameter): the part of each checkpoint tensor a tensor-parallel rank holds."""
    module_path, _, leaf = param_name.rpartition(".")
    parent_path, _, module_name = module_path.rpartition(".")
    sources = packed.get(module_name)
    if sources is None:
        parts = shard.fused_parts(leaf) if shard is not None else []
        if not parts:  # the whole tensor: one process, or a row-parallel bias (whole on every rank)
            tensor = source.get(param_name, param_name)
            require_shape(param_name, tensor, tuple(param.shape))
            param.data.copy_(tensor)
            return
        for first_row, part in parts:
            _copy_part(param, first_row, source.get(param_name, param_name, part), part, param_name)
        return
    prefix = f"{parent_path}." if parent_path else ""
    names = [f"{prefix}{part}.{leaf}" for part in sources]
    output_sizes = _output_sizes(model, module_path, len(names))
    row = 0
    for index, (name, rows) in enumerate(zip(names, output_sizes)):
        part = shard.part(leaf, index) if shard is not None else None
        tensor = source.get(name, param_name, part)
        require_shape(name, tensor, (rows, *param.shape[1:]))
        param.data[row:row + rows].copy_(tensor)
        row += rows
    if row != param.shape[0]:
        raise ValueError(f"parameter {param_name!r} has {param.shape[0]} rows but its sources give {row}")


def _copy_part(param: torch.Tensor, first_row: int, tensor: torch.Tensor, part, name: str) -> None:
    """A shard's part into the parameter: columns (dim 1) fill it, rows go from ``first_row`` on. Rows past
    the vocabulary's last token (the last shard's padding, which no checkpoint row fills) become zero."""
    expected = list(param.shape)
    expected[part.dim] = part.length
    require_shape(name, tensor, tuple(expected))
    if part.dim == 1:
        param.data.copy_(tensor)
        return
    param.data[first_row:first_row + part.length].copy_(tensor)
    if part.start + part.length == part.full and first_row + part.length < param.shape[0]:
        param.data[first_row + part.length:].zero_()


def _output_sizes(model: nn.Module, module_path: str, num_sources: int) -> tuple[int, ...]:
    sizes = tuple(getattr(model.get_submodule(module_path), "output_sizes", ()))
    if len(sizes) != num_sources:
        raise ValueError(f"module {module_path!r} is packed from {num_sources} tensors but declares "
                         f"output_sizes {sizes}")
    return sizes


def require_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
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


__all__ = ["INDEX_FILE", "LOAD_FORMATS", "SINGLE_FILE", "CheckpointReader", "MissingTensorError", "ModuleLoaded",
           "TensorSource",
           "checkpoint_files", "checkpoint_tensor_names", "init_dummy_weights", "load_checkpoint_weights",
           "load_weights", "require_shape"]
