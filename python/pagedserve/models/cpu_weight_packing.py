"""CPU weight packing: linear weights stored as bf16 tiles, arithmetic in float32.

A decode step on a CPU streams every weight once and runs out of memory
bandwidth and FMA throughput together; torch's float32 GEMM repacks the
weight on every call. For a bf16 checkpoint run in float32 the weights are
exactly bf16 values, so keeping them packed as bf16 (``ops.pack_linear_weight``,
layout in cpp/ops/packed_weight_layout.h) halves the bytes each step reads
and changes no weight: outputs match the float32 GEMM up to summation order.

Modes (``EngineConfig.cpu_weight_dtype``):
  "auto"     pack when the model computes in float32 and every linear weight
             (and the LM head) is exactly representable in bf16 (lossless);
  "bfloat16" pack float32 weights whatever they are (rounds to bf16);
  "float32"  never pack (torch's float32 GEMM).

Precision (``EngineConfig.cpu_precision``, resolved to "float32" or
"bfloat16" by engine_config.resolve_cpu_precision): "bfloat16" packs every
linear and the LM head (rounding weights that are not bf16) into kernels
that also round the activations to bf16 (PackedBf16Activations: AVX512_BF16
/ AMX dot products). Quantization "int8" (``EngineConfig.quantization``)
keeps every linear and the LM head as int8 channels instead (Int8Linear).
The MoE expert stacks keep their float32-exact packing in every mode.

Loading (StreamedPacking): the loader hands each linear over as soon as its
weight is filled, and the linear goes into its kernel there and then, so the
float32 model never exists whole (SmolLM2-135M: 520 MiB of float32 linears and
embeddings; the peak is now about the packed model plus one float32 matrix).
Where "auto" decides from every weight's values (float32 precision), each exact
weight waits as bf16 (half the bytes, widened back exactly if some matrix turns
out not to be bf16) until pack_cpu_weights decides at the end. The kernels and
their bytes are the same as packing the loaded model whole.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedserve.models.layers import Embedding, Linear
from pagedserve.models.linear_kernels import PackedBf16, PackedBf16Activations

logger = logging.getLogger("pagedserve")

CPU_WEIGHT_DTYPES = ("auto", "bfloat16", "float32")
CPU_PRECISIONS = ("float32", "bfloat16")
QUANTIZATIONS = ("none", "int8")


def is_bf16_exact(weight: torch.Tensor) -> bool:
    return bool(torch.equal(weight, weight.to(torch.bfloat16).to(weight.dtype)))


def _layer_linears(model: nn.Module) -> list[tuple[str, Linear]]:
    """The decoder's linears still holding a float weight (a GGUF model's quantized ones already run a
    kernel; the LM head, tied or not, is packed by the model itself)."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, Linear) and module is not model.lm_head and module.kernel is None]


def _lm_head(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [] if model.lm_head_kernel is not None else [("lm_head", model.lm_head_weight())]


def _grouped_weight_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules holding stacks of matrices that pack themselves (the MoE experts: packable_matrices + pack)."""
    return [(name, module) for name, module in model.named_modules()
            if not isinstance(module, Linear) and hasattr(module, "packable_matrices")]


def _packable(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, weight) of every matrix the step multiplies by: linears, expert stacks and the LM head."""
    grouped = [(f"{name}.{leaf}", weight) for name, module in _grouped_weight_modules(model)
               for leaf, weight in module.packable_matrices()]
    return [(name, linear.weight) for name, linear in _layer_linears(model)] + grouped + _lm_head(model)


def _check_options(mode: str, precision: str, quantization: str) -> None:
    if mode not in CPU_WEIGHT_DTYPES:
        raise ValueError(f"cpu_weight_dtype {mode!r} is not supported; use one of {', '.join(CPU_WEIGHT_DTYPES)}")
    if precision not in CPU_PRECISIONS:
        raise ValueError(f"cpu_precision {precision!r} is not resolved; use one of {', '.join(CPU_PRECISIONS)}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported; use one of {', '.join(QUANTIZATIONS)}")


def pack_cpu_weights(model: nn.Module, mode: str = "auto", precision: str = "float32",
                     quantization: str = "none") -> bool:
    """Puts ``model``'s linear weights and LM head into CPU kernels per ``mode``, ``precision`` and
    ``quantization`` (see the module docstring); returns whether it did. Linears already in a kernel
    (StreamedPacking's) stay as they are."""
    _check_options(mode, precision, quantization)
    config = model.config
    on_cpu = next(model.parameters()).device.type == "cpu"
    if quantization != "none" and (config.dtype != torch.float32 or not on_cpu):
        raise ValueError(f"quantization {quantization!r} needs a float32 model on the CPU (dtype auto or float32, "
                         f"device cpu); got {config.dtype} on {next(model.parameters()).device}")
    if on_cpu and not _packable(model):  # every matrix already runs a CPU kernel (a GGUF model's blocks)
        return True
    if quantization == "int8":
        from pagedserve.models.int8_linear import Int8Linear

        return _use_kernels(model, Int8Linear, "int8 channels")
    if mode == "float32" or config.dtype != torch.float32 or not on_cpu:
        return False
    if precision == "bfloat16":
        return _use_kernels(model, PackedBf16Activations, "bf16 tiles with bf16 activations")
    if mode == "auto":
        inexact = next((name for name, weight in _packable(model) if not is_bf16_exact(weight)), None)
        if inexact is not None:
            logger.info("CPU weights stay float32: %s is not exactly bf16", inexact)
            return False
    return _use_kernels(model, PackedBf16, "bf16 tiles, lossless" if mode == "auto" else "bf16 tiles, rounded")


def _use_kernels(model: nn.Module, kernel_class, what: str) -> bool:
    """Every decoder linear and the LM head into kernel_class(weight); the expert stacks into their bf16 tiles."""
    count = len(_packable(model)) + sum(1 for module in model.modules()
                                        if isinstance(module, Linear) and isinstance(module.kernel, kernel_class))
    for _, linear in _layer_linears(model):
        linear.use_kernel(kernel_class(linear.weight))
    for _, module in _grouped_weight_modules(model):
        module.pack()
    if model.lm_head_kernel is None:
        model.use_lm_head_kernel(kernel_class(model.lm_head_weight()))
    logger.info("CPU weights: %d matrices as %s", count, what)
    return True


def _kernel_whatever_the_values(dtype: torch.dtype, mode: str, precision: str, quantization: str):
    """(kernel class, description) every decoder linear of a float32 CPU model gets in pack_cpu_weights
    whatever its weight holds; None where no kernel does, or where "auto" decides from all the values."""
    if dtype != torch.float32:
        return None
    if quantization == "int8":
        from pagedserve.models.int8_linear import Int8Linear

        return Int8Linear, "int8 channels"
    if mode == "float32":
        return None
    if precision == "bfloat16":
        return PackedBf16Activations, "bf16 tiles with bf16 activations"
    return (PackedBf16, "bf16 tiles, rounded") if mode == "bfloat16" else None


class StreamedPacking:
    """pack_cpu_weights a linear at a time while a CPU model loads (the loader's on_module_loaded; see the
    module docstring), then finish(model) for the LM head, the expert stacks and the decision "auto" makes."""

    def __init__(self, dtype: torch.dtype, mode: str = "auto", precision: str = "float32",
                 quantization: str = "none"):
        _check_options(mode, precision, quantization)
        self.options = (mode, precision, quantization)
        self.kernel = _kernel_whatever_the_values(dtype, mode, precision, quantization)
        # "auto" under float32 precision packs only if every weight is exactly bf16: hold them as bf16 until then.
        self._may_pack_lossless = (self.kernel is None and dtype == torch.float32 and mode == "auto"
                                   and quantization == "none")
        self._waiting: list[nn.Module] = []  # linears and tables holding their exact weight as bf16

    def __call__(self, model: nn.Module, module: nn.Module) -> None:
        if type(module) is Embedding and module.weight is not None and module.weight.device.type == "cpu":
            self._narrow_table(module)
            return
        if (not isinstance(module, Linear) or module is model.lm_head or module.kernel is not None
                or module.weight is None or module.weight.device.type != "cpu"):
            return
        if self.kernel is not None:
            module.use_kernel(self.kernel[0](module.weight))
        elif self._may_pack_lossless:
            narrow = module.weight.to(torch.bfloat16)
            if torch.equal(narrow.to(module.weight.dtype), module.weight):
                module.weight = nn.Parameter(narrow, requires_grad=False)
                self._waiting.append(module)
            else:  # this model stays float32 (pack_cpu_weights will say which matrix)
                self._may_pack_lossless = False
                self._widen_waiting()

    def finish(self, model: nn.Module) -> bool:
        """Packs the rest as pack_cpu_weights does; returns whether the model runs CPU kernels."""
        packed = pack_cpu_weights(model, *self.options)
        if not packed:
            self._widen_waiting()
        self._waiting = []
        return packed

    def _narrow_table(self, table: Embedding) -> None:
        """An embedding table whose entries are all bf16 kept as bf16 now rather than when the LM head is
        packed (Decoder.use_lm_head_kernel does the same): the LM head, tied or not, gets a kernel in these
        modes, and a tied one is packed from the bf16 table, the same values."""
        if self.kernel is not None:
            table.keep_bf16_if_exact()
        elif self._may_pack_lossless and table.keep_bf16_if_exact():
            self._waiting.append(table)

    def _widen_waiting(self) -> None:
        """The waiting weights back to float32 (exact: they are bf16 values)."""
        for module in self._waiting:
            if isinstance(module, Embedding):
                module.widen()
            elif module.weight is not None:
                module.weight = nn.Parameter(module.weight.to(torch.float32), requires_grad=False)
        self._waiting = []


__all__ = ["CPU_PRECISIONS", "CPU_WEIGHT_DTYPES", "QUANTIZATIONS", "StreamedPacking", "is_bf16_exact",
           "pack_cpu_weights"]
