"""async_scheduling (run-ahead) against the plain step loop on the default model: the same tokens, logprobs,
texts and finish reasons for every request whose result does not depend on its batch (greedy and seeded
draws), across EOS, stop strings, stop token ids, max_tokens, min_tokens, penalties, JSON-schema grammars,
prompt logprobs, parallel samples, a prefix-cache hit, preemptions in a small KV pool and an abort; and every block back in the pool after.

Run-ahead schedules step N+1 before step N's tokens reach the host, so its steps differ (a row finished
by EOS runs once more, blocks come back a step later); only what the requests receive must not. On the
CPU it is off by default (nothing to overlap) but runs the same code as on CUDA, where it is on.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine_helpers import finished_outputs
from pagedserve import LLM, SamplingParams, StructuredOutputsParams, _core

SHARED_PREFIX = np.random.default_rng(3).integers(100, 30000, size=40).tolist()


def workload(prompt_logprobs: bool = True) -> tuple[list[dict], list[SamplingParams]]:
    rng = np.random.default_rng(11)
    prompts, params = [], []
    for i in range(24):
        tokens = rng.integers(100, 30000, size=int(rng.integers(3, 30))).tolist()
        if i % 6 == 0:
            tokens = SHARED_PREFIX + tokens  # prefix-cache hits after the first
        kind = i % 8
        p = dict(max_tokens=int(rng.integers(4, 28)), logprobs=2 if i % 3 == 0 else None)
        if kind == 0:
            p.update(temperature=0.0)  # greedy, EOS allowed
        elif kind == 1:
            p.update(temperature=0.8, seed=100 + i)  # a seeded draw: its own generator
        elif kind == 2:
            p.update(temperature=0.0, stop=[" the", "."])  # stop strings, found on the host
        elif kind == 3:
            p.update(temperature=0.0, min_tokens=6, ignore_eos=False)  # EOS masked for 6 tokens
        elif kind == 4:
            p.update(temperature=0.0, repetition_penalty=1.3)  # its rows are built once the last token is in
        elif kind == 5:
            p.update(temperature=0.9, seed=7 + i, n=2)  # forks after its prefill
        elif kind == 6:
            # exactly max_tokens; prompt logprobs keep the plain order until recorded
            p.update(temperature=0.0, ignore_eos=True, prompt_logprobs=1 if prompt_logprobs else None)
        else:
            p.update(temperature=0.0, stop_token_ids=[int(t) for t in rng.integers(100, 30000, size=30)])
        prompts.append({"prompt_token_ids": tokens})
        params.append(SamplingParams(**p))
    for i, temperature in enumerate((0.0, 0.7)):  # grammars: masks made after the last token is accepted
        schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                  "required": ["name", "age"]}
        so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        prompts.append({"prompt_token_ids": rng.integers(100, 30000, size=12).tolist()})
        params.append(SamplingParams(structured_outputs=so, max_tokens=30, temperature=temperature, seed=3 + i))
    return prompts, params


def outcome(output) -> list[tuple]:
    rows = []
    for c in output.outputs:
        logprobs = None if c.logprobs is None else [sorted((t, lp.logprob) for t, lp in s.items()) for s in c.logprobs]
        rows.append((c.index, list(c.token_ids), c.text, c.finish_reason, c.stop_reason, logprobs))
    prompt = None if output.prompt_logprobs is None else [
        None if step is None else sorted((t, lp.logprob) for t, lp in step.items()) for step in output.prompt_logprobs]
    return rows + [prompt]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and _core.has_cuda else [])


@pytest.fixture(scope="module", params=DEVICES)
def engines(request, default_model_path):
    # CPU: 16 blocks of 16 tokens for 24 requests of up to ~100 tokens (preemptions while they run), prompts in
    # chunks of a 64-token budget, prefix-cache hits: the CPU's results do not depend on any of them. CUDA: the
    # two loops' batches differ, so the products must not depend on the batch (batch_invariant); that setting
    # covers decode batches, not a prompt's chunking, a cache hit or a preempted sequence's recompute, which
    # the CUDA run leaves out (a whole-prompt budget, no prefix cache, the default pool).
    device = request.param
    if device == "cpu":
        setting = dict(num_kv_blocks=16, max_num_batched_tokens=64)
    else:
        setting = dict(batch_invariant=True, enable_prefix_caching=False, max_num_batched_tokens=2048,
                       gpu_memory_utilization=0.3)
    options = dict(model=str(default_model_path), device=device, max_model_len=256, max_num_seqs=16, **setting)
    plain, ahead = LLM(**options, async_scheduling="off"), LLM(**options, async_scheduling="on")
    yield plain, ahead
    plain.shutdown()
    ahead.shutdown()


def test_same_outputs_with_and_without_run_ahead(engines):
    plain, ahead = engines
    on_cpu = ahead.llm_engine.worker.device.type == "cpu"
    # The engine's handling of prompt logprobs is the same on every device; on CUDA their eager prefills
    # would also have to be batch-invariant across the two loops' different batches, which is not claimed.
    prompts, params = workload(prompt_logprobs=on_cpu)
    want = [outcome(o) for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [outcome(o) for o in ahead.generate(prompts, params, use_tqdm=False)]
    for i, (w, g) in enumerate(zip(want, got)):
        assert g == w, f"request {i} ({params[i]})"
    stats = ahead.llm_engine.stats()
    # Steps without grammar rows or prompt logprobs ran ahead: 18 on an H200 (whole prompts, one batch of
    # decodes), more on the CPU (chunked prompts, preemptions).
    assert stats["num_steps_run_ahead"] > 10
    assert plain.llm_engine.stats()["num_steps_run_ahead"] == 0
    if on_cpu:
        assert stats["num_preemptions"] > 0  # the small pool did preempt
    for rows in want[-2:]:  # the grammars held: JSON objects with both keys
        text, reason = rows[0][2], rows[0][3]
        assert reason == "length" or set(json.loads(text)) == {"name", "age"}, text
    assert sum(rows[-1] is not None for rows in want) == (3 if on_cpu else 0)  # the prompt logprobs came back
    finish_reasons = {row[3] for rows in want for row in rows[:-1]}
    assert finish_reasons == {"stop", "length"}
    for llm in engines:  # every block back (cached prompt blocks stay evictable)
        assert llm.llm_engine.stats()["num_used_blocks"] == 0


def test_abort_while_a_step_is_advanced(engines):
    _, ahead = engines
    engine = ahead.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": [100 + i, 200, 300]}, params, stream=False)
    for _ in range(5):
        engine.step()
    assert engine.scheduler.has_advanced
    finals = engine.abort_request(["abort-0", "abort-3"])
    assert [f.outputs[0].finish_reason for f in finals] == ["abort", "abort"]
    assert len(finals[0].outputs[0].token_ids) == 5  # the advanced step's token was committed first
    done = finished_outputs(engine)
    assert sorted(done) == ["abort-1", "abort-2", "abort-4", "abort-5"]
    assert all(len(o.outputs[0].token_ids) == 40 for o in done.values())
    assert engine.stats()["num_used_blocks"] == 0
    assert not engine.scheduler.has_advanced
