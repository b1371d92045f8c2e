"""Packing while loading (StreamedPacking, the CPU worker's path) ends in exactly the model that loading
whole and then pack_cpu_weights gives: the same kernels holding the same bytes, the same float weights
where nothing packs, the same embedding table, in every CPU mode, including checkpoints where "auto"
finds a matrix that is not bf16 halfway through or only at the LM head."""

from __future__ import annotations

import pytest
import torch

from hf_helpers import round_to_bf16, save_hf_checkpoint
from pagedserve.models import build_model
from pagedserve.models.cpu_weight_packing import StreamedPacking, pack_cpu_weights
from pagedserve.models.int8_linear import Int8Linear
from pagedserve.models.layers import Embedding, Linear
from pagedserve.models.linear_kernels import PackedBf16
from pagedserve.models.model_config import ModelConfig

# (cpu_weight_dtype, resolved cpu_precision, quantization)
MODES = [("auto", "float32", "none"), ("auto", "bfloat16", "none"), ("bfloat16", "float32", "none"),
         ("float32", "float32", "none"), ("auto", "float32", "int8")]


def _kernel_state(kernel) -> list:
    if kernel is None:
        return [None]
    if isinstance(kernel, PackedBf16):
        return [type(kernel).__name__, kernel.packed]
    if isinstance(kernel, Int8Linear):
        return [type(kernel).__name__, kernel.weight.packed, kernel.weight.scales]
    raise AssertionError(f"unexpected kernel {kernel!r}")


def _state(model) -> dict[str, list]:
    """Every module's weights as the steps will read them."""
    out = {"lm_head_kernel": _kernel_state(model.lm_head_kernel)}
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            out[name] = _kernel_state(module.kernel) + [module.weight, module.bias]
        elif isinstance(module, Embedding):
            out[name] = [module.weight]
    return out


def _assert_same(streamed: dict, whole: dict) -> None:
    assert streamed.keys() == whole.keys()
    for name in whole:
        assert len(streamed[name]) == len(whole[name]), name
        for a, b in zip(streamed[name], whole[name]):
            if isinstance(b, torch.Tensor):
                assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), name
            else:
                assert a == b, name


def _checkpoint(tiny_checkpoint, kind: str):
    hf, path = tiny_checkpoint(tie_word_embeddings=kind.startswith("tied"))
    if kind == "float32":
        return path  # random float32 values: "auto" finds the first matrix inexact
    round_to_bf16(hf)
    with torch.no_grad():
        if kind == "bf16, last down_proj not bf16":  # found after every other linear waits as bf16
            hf.model.layers[-1].mlp.down_proj.weight.add_(1e-4)
        if kind == "bf16, lm_head not bf16":  # found only when the LM head is packed
            hf.lm_head.weight.add_(1e-4)
    save_hf_checkpoint(hf, path)
    return path


@pytest.mark.parametrize("kind", ["tied bf16", "bf16", "float32", "bf16, last down_proj not bf16",
                                  "bf16, lm_head not bf16"])
@pytest.mark.parametrize("mode,precision,quantization", MODES)
def test_streamed_packing_equals_packing_the_loaded_model(tiny_checkpoint, kind, mode, precision, quantization):
    config = ModelConfig.from_model_dir(_checkpoint(tiny_checkpoint, kind), dtype="float32", device="cpu")
    whole = build_model(config, "cpu")
    whole_packed = pack_cpu_weights(whole, mode, precision, quantization)
    packing = StreamedPacking(config.dtype, mode, precision, quantization)
    streamed = build_model(config, "cpu", on_module_loaded=packing)
    assert packing.finish(streamed) == whole_packed
    _assert_same(_state(streamed), _state(whole))
    ids = torch.arange(16)
    assert torch.equal(streamed.model.embed_tokens(ids), whole.model.embed_tokens(ids))


def test_streamed_packing_packs_each_linear_as_it_loads(tiny_checkpoint):
    """When the loader hands over the second linear, the first already holds only its kernel."""
    _, path = tiny_checkpoint()
    config = ModelConfig.from_model_dir(path, dtype="float32", device="cpu")
    packing = StreamedPacking(config.dtype, "auto", "bfloat16", "none")
    seen: list[tuple[Linear, bool]] = []

    def loaded(model, module):
        seen.extend((linear, linear.weight is None) for linear in model.modules()
                    if isinstance(linear, Linear) and linear is not module and linear.kernel is not None)
        packing(model, module)

    build_model(config, "cpu", on_module_loaded=loaded)
    assert seen and all(freed for _, freed in seen)


def test_streamed_packing_rejects_unknown_modes():
    with pytest.raises(ValueError, match="cpu_weight_dtype"):
        StreamedPacking(torch.float32, "int4")
    with pytest.raises(ValueError, match="cpu_precision"):
        StreamedPacking(torch.float32, "auto", "auto")
