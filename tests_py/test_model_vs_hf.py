"""Our paged forward against Hugging Face transformers on tiny random checkpoints (float32, CPU).

Each sequence's reference is HF's logits over the whole sequence (causal, so
the logits at position p see exactly the tokens our paged cache holds for p).
Our side runs the sequences batched together through a scattered block pool,
with chunked prefills and several decode steps.
"""

from __future__ import annotations

import copy
import zlib

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from hf_helpers import make_hf_model, save_hf_checkpoint
from paged_helpers import PagedBatchRunner, relative_error
from pagedserve.models.model_config import ModelConfig
from pagedserve.models import build_model
from pagedserve.models.cpu_weight_packing import pack_cpu_weights
from pagedserve.models.layers import Linear

TOLERANCE = 1e-4  # relative (Frobenius) error of float32 logits

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, vocab_size=320,
              max_position_embeddings=128)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 500000.0}

# name -> (config class, config overrides, max_shard_size)
CASES = {
    "llama_gqa_untied": (LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=2,
                                           tie_word_embeddings=False), None),
    "llama_mha_tied_biases": (LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=4,
                                                tie_word_embeddings=True, attention_bias=True, mlp_bias=True), None),
    "llama3_rope_gqa4_sharded": (LlamaConfig, dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                                                   rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=False),
                                 "60KB"),
    "mistral_full_attention": (MistralConfig, dict(num_attention_heads=4, num_key_value_heads=1,
                                                   sliding_window=None, tie_word_embeddings=False), None),
    "qwen2_tied": (Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True), None),
    "qwen3_wide_heads": (Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                           tie_word_embeddings=False), None),
    "qwen3_biases_tied": (Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                            attention_bias=True, tie_word_embeddings=True), None),
}

# Three sequences (prompt length, decode steps) scheduled like continuous batching:
# A prefills at once, B is chunked over three steps, C arrives later; decodes run alongside.
PROMPTS = {"A": 17, "B": 35, "C": 9}
SCHEDULE = [
    [("A", 17), ("B", 12)],
    [("A", 1), ("B", 18)],
    [("A", 1), ("B", 5), ("C", 9)],
    [("A", 1), ("B", 1), ("C", 1)],
    [("A", 1), ("B", 1), ("C", 1)],
    [("B", 1), ("C", 1)],
    [("A", 1), ("B", 1), ("C", 1)],
]


def sequence_lengths() -> dict[str, int]:
    totals = {name: 0 for name in PROMPTS}
    for step in SCHEDULE:
        for name, count in step:
            totals[name] += count
    return totals


@pytest.fixture(params=list(CASES), scope="module")
def case(request, tmp_path_factory):
    config_cls, overrides, shard_size = CASES[request.param]
    hf_model = make_hf_model(config_cls, seed=zlib.crc32(request.param.encode()) % 1000, **{**COMMON, **overrides})
    path = save_hf_checkpoint(hf_model, tmp_path_factory.mktemp(request.param), max_shard_size=shard_size)
    if shard_size:
        assert (path / "model.safetensors.index.json").is_file(), "the sharded case must really be sharded"
    return request.param, hf_model, path


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_paged_batch_matches_hf(case, index_dtype):
    name, hf_model, path = case
    config = ModelConfig.from_model_dir(path, dtype="float32", device="cpu")
    model = build_model(config, "cpu")
    assert_schedule_matches_hf(name, hf_model, model, index_dtype)


def test_packed_bf16_weights_match_hf(case, tmp_path):
    """The CPU's bf16 weight tiles (cpu_weight_packing.py) on a checkpoint whose weights are bf16
    values: lossless, so float32 logits still match transformers'."""
    name, hf_model, _ = case
    bf16_valued = copy.deepcopy(hf_model)
    with torch.no_grad():
        for param in bf16_valued.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    path = save_hf_checkpoint(bf16_valued, tmp_path / name)
    model = build_model(ModelConfig.from_model_dir(path, dtype="float32", device="cpu"), "cpu")
    assert pack_cpu_weights(model, "auto")
    linears = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    assert linears and all(m.kernel is not None and m.weight is None for m in linears)
    assert model.lm_head_kernel is not None
    assert_schedule_matches_hf(name, bf16_valued, model, torch.int32)


def assert_schedule_matches_hf(name: str, hf_model, model, index_dtype: torch.dtype) -> None:
    config = model.config
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    tokens = {seq: torch.randint(0, config.vocab_size, (length,), generator=generator)
              for seq, length in sequence_lengths().items()}
    with torch.no_grad():
        reference = {seq: hf_model(ids[None]).logits[0] for seq, ids in tokens.items()}

    runner = PagedBatchRunner(model, block_size=4, num_blocks=64, seed=7, index_dtype=index_dtype)
    for seq, ids in tokens.items():
        runner.add(seq, ids.tolist())
    for step_index, step in enumerate(SCHEDULE):
        starts = {seq: runner.sequences[seq].num_computed for seq, _ in step}
        logits = runner.step(step)
        for seq, count in step:
            expected = reference[seq][starts[seq]:starts[seq] + count]
            assert logits[seq].dtype == torch.float32
            error = relative_error(logits[seq], expected)
            assert error < TOLERANCE, f"{name} step {step_index} seq {seq}: relative error {error:.2e}"
            assert_same_greedy_tokens(logits[seq], expected)


def assert_same_greedy_tokens(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """argmax agrees wherever the reference's top two logits are not a near-tie."""
    top2 = expected.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-3
    assert torch.equal(actual.argmax(-1)[clear], expected.argmax(-1)[clear])


def test_batching_does_not_change_results(case):
    """The same sequence alone and inside a mixed batch gives the same logits (no cross-row leakage)."""
    _, _, path = case
    config = ModelConfig.from_model_dir(path, dtype="float32", device="cpu")
    model = build_model(config, "cpu")
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, config.vocab_size, (13,), generator=generator).tolist()
    other = torch.randint(0, config.vocab_size, (21,), generator=generator).tolist()

    alone = PagedBatchRunner(model, seed=1)
    alone.add("x", ids)
    solo = alone.step([("x", 13)])["x"]

    mixed = PagedBatchRunner(model, seed=2)
    mixed.add("x", ids)
    mixed.add("y", other)
    mixed.step([("y", 11)])
    together = mixed.step([("y", 10), ("x", 13)])["x"]
    assert relative_error(together, solo) < 1e-5
