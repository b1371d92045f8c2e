"""CPU memory: the embedding table kept in the checkpoint's bf16 under a float32 model, and freed
heap given back after large steps (worker/heap_trim.py)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.models.cpu_weight_packing import pack_cpu_weights
from pagedserve.models.layers import Embedding
from pagedserve.worker.heap_trim import TRIM_AFTER_TOKENS, HeapTrimmer


def test_bf16_table_gathers_the_same_float32_rows():
    table = Embedding(100, 24, torch.float32, torch.device("cpu"))
    table.weight.data.copy_(torch.randn(100, 24).to(torch.bfloat16).float())
    ids = torch.tensor([0, 99, 5, 5, 42])
    before = table(ids)
    assert table.keep_bf16_if_exact() and table.weight.dtype == torch.bfloat16
    after = table(ids)
    assert after.dtype == torch.float32 and torch.equal(after, before)


def test_inexact_table_stays_float32():
    table = Embedding(10, 8, torch.float32, torch.device("cpu"))
    table.weight.data.copy_(torch.randn(10, 8))
    assert not table.keep_bf16_if_exact() and table.weight.dtype == torch.float32


def _tied_model(tiny_checkpoint, bf16_values: bool):
    from hf_helpers import round_to_bf16

    from pagedserve.models import build_model
    from pagedserve.models.model_config import ModelConfig

    hf, path = tiny_checkpoint(tie_word_embeddings=True)
    if bf16_values:
        round_to_bf16(hf)
    hf.save_pretrained(path)
    return build_model(ModelConfig.from_model_dir(path, dtype="float32", device="cpu"), "cpu")


def test_tied_head_tiles_serve_the_lookups_when_the_table_is_bf16(tiny_checkpoint):
    """A bf16-valued tied checkpoint: after packing, the table is gone, lookups gather the same float32 rows
    from the head's tiles, and the logits come from those tiles, equal to the float32 product with the
    original table up to summation order."""
    model = _tied_model(tiny_checkpoint, bf16_values=True)
    table = model.model.embed_tokens.weight.detach().clone()
    hidden = torch.randn(3, table.shape[1])
    assert pack_cpu_weights(model, "auto")
    assert model.model.embed_tokens.weight is None
    ids = torch.tensor([[0, table.shape[0] - 1, 17], [16, 15, 17]])
    rows = model.model.embed_tokens(ids)
    assert rows.dtype == torch.float32 and torch.equal(rows, table[ids])
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ table.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode,quantization,table_dtype", [("bfloat16", "none", torch.float32),
                                                          ("auto", "int8", torch.float32)])
def test_tied_table_is_kept_where_the_tiles_do_not_hold_it(tiny_checkpoint, mode, quantization, table_dtype):
    """Random float32 values: rounded tiles (cpu_weight_dtype bfloat16) or int8 channels are not the table,
    so lookups keep reading the float32 table itself."""
    model = _tied_model(tiny_checkpoint, bf16_values=False)
    table = model.model.embed_tokens.weight.detach().clone()
    assert pack_cpu_weights(model, mode, quantization=quantization)
    assert model.model.embed_tokens.weight.dtype == table_dtype
    assert torch.equal(model.model.embed_tokens(torch.arange(table.shape[0])), table)


def test_int8_head_keeps_a_bf16_table(tiny_checkpoint):
    model = _tied_model(tiny_checkpoint, bf16_values=True)
    table = model.model.embed_tokens.weight.detach().clone()
    assert pack_cpu_weights(model, "auto", quantization="int8")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(model.model.embed_tokens(torch.arange(table.shape[0])), table)


def test_heap_is_trimmed_once_after_a_large_step_not_every_step():
    heap = HeapTrimmer()
    before = heap.trims
    for tokens in [64] * 5 + [TRIM_AFTER_TOKENS * 6] + [64] * 10:  # a big prefill, then decodes
        heap.note_step(tokens)
    assert heap.trims - before == 1
    for tokens in [TRIM_AFTER_TOKENS - 1, 10, 10]:  # small steps never trim
        heap.note_step(tokens)
    assert heap.trims - before == 1


@pytest.mark.parametrize("rows,cols", [(37, 70), (16, 32), (1, 5), (49, 576)])
def test_rows_gathered_from_tiles_equal_the_table(rows, cols):
    from pagedserve import ops
    from pagedserve.models.linear_kernels import PackedBf16Rows

    table = torch.randn(rows, cols).to(torch.bfloat16)
    lookup = PackedBf16Rows(ops.pack_linear_weight(table), rows, cols)
    ids = torch.randint(0, rows, (3, 7))
    got = lookup(ids)
    assert got.dtype == torch.float32 and got.shape == (3, 7, cols) and torch.equal(got, table[ids].float())
