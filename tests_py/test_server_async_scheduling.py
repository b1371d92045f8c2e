"""The server with run-ahead (async_scheduling on, CPU here; CUDA's default): completions through the official
openai client carry the same tokens, logprobs and text as the offline engine without it (stop strings, n > 1
with a seed, logprobs, a chat stream); a client that drops its stream mid-way loses nothing for the others
and leaves no block held."""

from __future__ import annotations

import openai
import pytest

from pagedserve import LLM
from server_process import CPU_ARGS, ServerProcess

PROMPT = "The three primary colors are"
CASES = [
    dict(max_tokens=24, temperature=0.0, logprobs=2),
    dict(max_tokens=40, temperature=0.0, stop=["."]),
    dict(max_tokens=16, temperature=0.8, seed=5, n=2),
]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(*CPU_ARGS, "--async-scheduling", "on", "--max-num-seqs", "8") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def offline(default_model_path) -> list[list[tuple]]:
    llm = LLM(str(default_model_path), device="cpu", max_model_len=1024, async_scheduling="off")
    try:
        results = []
        for case in CASES:
            params = llm.llm_engine.default_sampling_params(**case)  # the model's defaults, as the server applies
            out = llm.generate(PROMPT, params, use_tqdm=False)[0]
            results.append([(c.text, c.finish_reason, None if c.logprobs is None else
                              [max(step.values(), key=lambda lp: lp.logprob).logprob for step in c.logprobs])
                             for c in out.outputs])
        return results
    finally:
        llm.shutdown()


def test_completions_match_the_engine_without_run_ahead(server, client, default_model_path):
    model = client.models.list().data[0].id
    want = offline(default_model_path)
    for case, expected in zip(CASES, want):
        extra = {"seed": case["seed"]} if "seed" in case else {}
        response = client.completions.create(model=model, prompt=PROMPT, max_tokens=case["max_tokens"],
                                             temperature=case["temperature"], n=case.get("n", 1),
                                             stop=case.get("stop"), logprobs=case.get("logprobs"), **extra)
        got = []
        for choice in sorted(response.choices, key=lambda c: c.index):
            top = None if choice.logprobs is None else [max(d.values()) for d in choice.logprobs.top_logprobs]
            got.append((choice.text, choice.finish_reason, top))
        assert got == expected, case
    assert server.engine_state()["stats"]["num_steps_run_ahead"] > 0


def test_a_dropped_stream_leaves_the_others_served_and_no_block_held(server, client):
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to fifty."}],
                                            max_tokens=200, temperature=0.0, stream=True)
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()  # the server aborts it at the next step boundary
    done = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                          max_tokens=8, temperature=0.0)
    assert done.choices[0].finish_reason in ("stop", "length") and done.choices[0].message.content
    state = server.wait_idle()
    assert state["stats"]["num_used_blocks"] == 0
