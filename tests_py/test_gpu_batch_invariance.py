"""Batch invariance on the GPU (EngineConfig.batch_invariant, models/batch_invariant.py): a request's tokens
and per-token logprobs are bit-identical (==) alone and in batches of 16, 64 and 256 requests of mixed lengths,
in bf16 on the default model, with CUDA graphs (decode batches replay graphs of several sizes) and without;
the same run of the engine without the setting shows the difference it removes (not asserted: cuBLAS may
happen to agree). Mirrors tests_py/test_batch_invariance.py, which checks the CPU."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, _core

from test_batch_invariance import OUTPUT_LEN, prompts, run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and _core.has_cuda), reason="needs a CUDA GPU and USE_CUDA=ON"),
]


@pytest.fixture(scope="module", params=["graphs", "eager"])
def engine(request, default_model_path):
    llm = LLM(model=str(default_model_path), device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=256,
              batch_invariant=True, enforce_eager=request.param == "eager", gpu_memory_utilization=0.3)
    yield llm
    llm.shutdown()


def test_tokens_and_logprobs_are_bit_identical_in_any_batch(engine):
    alone = run(engine, [])
    assert len(alone[0]) == OUTPUT_LEN and all(len(step) >= 2 for step in alone[1])
    for size, seed, position in ((16, 1, 5), (64, 2, 40), (256, 3, 200)):
        got = run(engine, prompts(size - 1, seed=seed), position=position)
        assert got[0] == alone[0], f"batch of {size}: tokens {got[0]} != alone {alone[0]}"
        for step, (a, b) in enumerate(zip(got[1], alone[1])):
            assert a == b, f"batch of {size}: logprobs of token {step} differ: {a} != {b}"
