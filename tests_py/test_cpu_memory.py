"""CPU memory: the embedding table kept in the checkpoint's bf16 under a float32 model, and freed
heap given back after large steps (worker/heap_trim.py)."""

from __future__ import annotations

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


def test_tied_head_keeps_its_own_tiles_when_the_table_narrows(tiny_checkpoint):
    """A bf16-valued tied checkpoint: after packing, lookups read a bf16 table and the logits come from the
    head's own tiles, equal to the float32 product with the original table up to summation order."""
    from hf_helpers import round_to_bf16

    from pagedserve.models import build_model
    from pagedserve.models.model_config import ModelConfig

    hf, path = tiny_checkpoint(tie_word_embeddings=True)
    round_to_bf16(hf).save_pretrained(path)
    model = build_model(ModelConfig.from_model_dir(path, dtype="float32", device="cpu"), "cpu")
    table = model.model.embed_tokens.weight.detach().clone()
    hidden = torch.randn(3, table.shape[1])
    assert pack_cpu_weights(model, "auto")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(model.model.embed_tokens(torch.arange(table.shape[0])), table)
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ table.T, rtol=1e-5, atol=1e-5)


def test_heap_is_trimmed_once_after_a_large_step_not_every_step():
    heap = HeapTrimmer()
    before = heap.trims
    for tokens in [64] * 5 + [TRIM_AFTER_TOKENS * 6] + [64] * 10:  # a big prefill, then decodes
        heap.note_step(tokens)
    assert heap.trims - before == 1
    for tokens in [TRIM_AFTER_TOKENS - 1, 10, 10]:  # small steps never trim
        heap.note_step(tokens)
    assert heap.trims - before == 1
