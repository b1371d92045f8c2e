"""Batch invariance on the CPU: a request's tokens and per-token logprobs are bit-identical (==, not
allclose) alone, in a batch of 16 and of 64 other requests of mixed lengths, under chunked prefill
and on a prefix-cache hit, on the default model (its bf16 directory in three modes, and its shipped
Q4_1 GGUF file).

Nothing the engine computes for one row may depend on the other rows: each op reduces a row in an
order fixed by the row's own shape (cpp/ops/ops.h, paged_attention; the packed matmul keeps one
accumulator chain per row whatever the number of rows; the sampler's softmax runs per row).

The target prompt is 33 tokens: a 16-token budget chunks it 16 + 16 + 1, and a prefix-cache hit on
its two full blocks leaves its last token alone in the step, the cases where a decode-only kernel
would round the last prompt position differently from a longer prefill.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve import LLM, SamplingParams

MODES = {
    "default": {},
    "float32": {"cpu_precision": "float32"},
    "bf16-kv": {"kv_cache_dtype": "bfloat16"},
    "gguf": {},  # the default model's shipped Q4_1 file: blocks interleaved at load (cpp/ops/gguf_interleaved.h)
}
TARGET_LEN, OUTPUT_LEN = 33, 10
PARAMS = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True, logprobs=2)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 30000, size=int(length)).tolist() for length in rng.integers(3, 70, size=n)]


TARGET = np.random.default_rng(7).integers(100, 30000, size=TARGET_LEN).tolist()


def result(output) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """The tokens, and per token every (token id, logprob) returned, as exact floats."""
    completion = output.outputs[0]
    logprobs = [sorted((token, lp.logprob) for token, lp in step.items()) for step in completion.logprobs]
    return list(completion.token_ids), logprobs


def run(llm: LLM, others: list[list[int]], position: int = 0):
    batch = others[:position] + [TARGET] + others[position:]
    # The others generate different lengths, so the batch changes size while the target decodes.
    params = [PARAMS if i == position else SamplingParams(temperature=0.0, max_tokens=3 + i % 13, ignore_eos=True)
              for i in range(len(batch))]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return result(outs[position])


@pytest.fixture(scope="module", params=list(MODES))
def mode(request):
    return request.param


@pytest.fixture(scope="module")
def engines(mode, default_model_path):
    from pagedserve.engine_config import EngineConfig, resolve_cpu_precision

    if mode == "float32" and resolve_cpu_precision(EngineConfig(), "cpu", checkpoint_is_bf16=True) == "float32":
        pytest.skip("the default mode is float32 on this CPU (no bf16 dot product): the same engines")
    if mode == "gguf":
        from pagedserve.models.default_model import default_gguf_path
        default_model_path = default_gguf_path()
    options = dict(model=str(default_model_path), device="cpu", max_model_len=256, **MODES[mode])
    plain = LLM(**options, enable_prefix_caching=False, max_num_seqs=64)
    chunked = LLM(**options, enable_prefix_caching=True, max_num_seqs=16, max_num_batched_tokens=16)
    yield plain, chunked
    plain.shutdown()
    chunked.shutdown()


def test_tokens_and_logprobs_are_bit_identical_in_any_batch(engines):
    plain, chunked = engines
    alone = run(plain, [])
    assert len(alone[0]) == OUTPUT_LEN and all(len(step) >= 2 for step in alone[1])
    cases = {
        "in a batch of 16": run(plain, prompts(15, seed=1), position=5),
        "in a batch of 64": run(plain, prompts(63, seed=2), position=40),
        "chunked prefill (16-token budget), alone": run(chunked, []),
        "prefix-cache hit on 32 tokens, alone": run(chunked, []),
        "chunked prefill in a batch of 16, prefix-cache hit": run(chunked, prompts(15, seed=3), position=9),
    }
    for case, got in cases.items():
        assert got[0] == alone[0], f"{case}: tokens {got[0]} != alone {alone[0]}"
        for step, (a, b) in enumerate(zip(got[1], alone[1])):
            assert a == b, f"{case}: logprobs of token {step} differ: {a} != {b}"

