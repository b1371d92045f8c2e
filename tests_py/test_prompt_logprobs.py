"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' log_softmax over the same prompt:
whole prefills, chunked prefills, prefix-cache hits, preemption, and the server's echo + logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.engine.engine import LLMEngine
from pagedserve.errors import RequestError
from pagedserve.sampling_params import SamplingParams

TOL = 1e-4


def _hf_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0]
    return logits.float().log_softmax(dim=-1)


def _run(engine: LLMEngine, prompts: dict[str, list[int]], params, stream=False) -> dict:
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params if isinstance(params, SamplingParams) else params[rid], stream=stream)
    outs = {rid: [] for rid in prompts}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs if stream else {rid: o[-1] for rid, o in outs.items()}


def _check(prompt_logprobs, prompt: list[int], expected: torch.Tensor, top_n: int) -> None:
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entry, row = prompt_logprobs[i], expected[i - 1]
        token = prompt[i]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=TOL)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top_values, top_ids = row.topk(top_n)
        others = {t: lp for t, lp in entry.items() if lp.rank <= top_n}
        assert sorted(others) == sorted(top_ids.tolist()), i
        for rank, (tid, value) in enumerate(zip(top_ids.tolist(), top_values.tolist()), start=1):
            assert entry[tid].logprob == pytest.approx(value, abs=TOL) and entry[tid].rank == rank
        assert set(entry) <= set(top_ids.tolist()) | {token}


@pytest.fixture
def tiny(tiny_checkpoint):
    return tiny_checkpoint()


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 8}], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_transformers(tiny, options):
    hf_model, path = tiny
    engine = LLMEngine(model=str(path), device="cpu", block_size=4, max_num_seqs=4, **options)
    prompts = {"a": _prompt(1, 37), "b": _prompt(2, 5), "c": _prompt(3, 21), "one": _prompt(4, 1)}
    params = {"a": SamplingParams(max_tokens=3, prompt_logprobs=5, temperature=0),
              "b": SamplingParams(max_tokens=2, prompt_logprobs=0, logprobs=2),
              "c": SamplingParams(max_tokens=4),  # asks for none, in the same steps
              "one": SamplingParams(max_tokens=2, prompt_logprobs=3)}
    outs = _run(engine, prompts, params)
    _check(outs["a"].prompt_logprobs, prompts["a"], _hf_logprobs(hf_model, prompts["a"]), 5)
    _check(outs["b"].prompt_logprobs, prompts["b"], _hf_logprobs(hf_model, prompts["b"]), 0)
    assert all(len(e) == 1 for e in outs["b"].prompt_logprobs[1:])  # prompt_logprobs=0: the prompt token only
    assert outs["c"].prompt_logprobs is None
    assert outs["one"].prompt_logprobs == [None]
    assert len(outs["b"].outputs[0].logprobs) == 2  # the generated tokens' logprobs still come


def test_prompt_logprobs_through_prefix_cache_hits_equal_uncached(tiny):
    hf_model, path = tiny
    engine = LLMEngine(model=str(path), device="cpu", block_size=4, max_num_seqs=4, enable_prefix_caching=True)
    prompt = _prompt(5, 30)
    params = SamplingParams(max_tokens=2, prompt_logprobs=4)
    first = _run(engine, {"first": prompt}, params)["first"]
    second = _run(engine, {"second": prompt}, params)["second"]
    # a shared head, then a different tail: cached blocks, then computed ones
    third_prompt = prompt[:17] + _prompt(6, 9)
    third = _run(engine, {"third": third_prompt}, params)["third"]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 28 and third.num_cached_tokens == 16
    expected = _hf_logprobs(hf_model, prompt)
    _check(first.prompt_logprobs, prompt, expected, 4)
    _check(second.prompt_logprobs, prompt, expected, 4)
    for a, b in zip(first.prompt_logprobs[1:], second.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        assert all(math.isclose(a[t].logprob, b[t].logprob, abs_tol=1e-5) and a[t].rank == b[t].rank for t in a)
    _check(third.prompt_logprobs, third_prompt, _hf_logprobs(hf_model, third_prompt), 4)


def test_prompt_logprobs_survive_chunking_prefix_hits_and_preemption_together(tiny):
    hf_model, path = tiny
    # few blocks and a small budget: chunked prefills that preempt each other
    engine = LLMEngine(model=str(path), device="cpu", block_size=4, max_num_seqs=4, num_kv_blocks=16,
                       max_num_batched_tokens=8)
    prompts = {f"r{i}": _prompt(10 + i, 30) for i in range(3)}
    prompts["dup"] = list(prompts["r0"])
    outs = _run(engine, prompts, SamplingParams(max_tokens=30, prompt_logprobs=2, ignore_eos=True))
    assert sum(o.metrics.num_preemptions for o in outs.values()) >= 2
    for rid, prompt in prompts.items():
        _check(outs[rid].prompt_logprobs, prompt, _hf_logprobs(hf_model, prompt), 2)


def test_a_stream_hands_prompt_logprobs_back_with_its_first_output(tiny):
    _, path = tiny
    engine = LLMEngine(model=str(path), device="cpu", block_size=4, max_num_seqs=4)
    prompt = _prompt(7, 12)
    outs = _run(engine, {"s": prompt}, SamplingParams(max_tokens=4, prompt_logprobs=1, n=2), stream=True)["s"]
    assert len(outs[0].prompt_logprobs) == len(prompt)
    assert all(o.prompt_logprobs is None for o in outs[1:])


def test_prompt_logprobs_are_checked(tiny):
    _, path = tiny
    engine = LLMEngine(model=str(path), device="cpu", block_size=4, max_num_seqs=4, max_logprobs=5)
    with pytest.raises(RequestError) as err:
        engine.add_request("x", [1, 2, 3], SamplingParams(prompt_logprobs=6))
    assert err.value.field == "prompt_logprobs"
    with pytest.raises(RequestError):
        SamplingParams(prompt_logprobs=-1)


# ---------------------------------------------------------------------------- the server (default model, CPU)
PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "extra_body": {"repetition_penalty": 1.0}}


@pytest.fixture(scope="module")
def server():
    from server_process import ServerProcess

    with ServerProcess("--max-num-seqs", "4") as s:
        yield s


@pytest.fixture(scope="module")
def offline(server, default_model_path):
    """The offline API's prompt logprobs of PROMPT (the server's settings: CPU, float32, max_model_len 1024)."""
    from pagedserve.llm import LLM

    llm = LLM(str(default_model_path), device="cpu", max_model_len=1024, max_num_seqs=4)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0), use_tqdm=False)[0]
    llm.shutdown()
    return out


def _check_echoed(lp, offline, completion: str) -> None:
    ids, expected = offline.prompt_token_ids, offline.prompt_logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == PROMPT + completion
    assert lp.text_offset == sorted(lp.text_offset)
    for i in range(1, len(ids)):
        assert lp.tokens[i] == expected[i][ids[i]].decoded_token
        assert lp.token_logprobs[i] == pytest.approx(expected[i][ids[i]].logprob, abs=TOL)
        (top_text, top_value), = lp.top_logprobs[i].items()  # logprobs=1: the most likely token
        best = next(e for e in expected[i].values() if e.rank == 1)
        assert top_text == best.decoded_token and top_value == pytest.approx(best.logprob, abs=TOL)


def test_completions_echo_with_logprobs_puts_the_prompt_first(client, model, offline):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1, **GREEDY)
    choice = choice_of(out)
    num_prompt = len(offline.prompt_token_ids)
    assert out.usage.prompt_tokens == num_prompt and out.usage.completion_tokens == 1
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == num_prompt + 1
    assert choice.text.startswith(PROMPT)
    _check_echoed(lp, offline, choice.text[len(PROMPT):])
    assert lp.text_offset[num_prompt] == len(PROMPT)
    assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()), abs=TOL)  # greedy

    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1,
                                            stream=True, **GREEDY))
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in streamed) == choice.text
    tokens = [t for c in streamed if c.logprobs for t in c.logprobs.tokens]
    values = [v for c in streamed if c.logprobs for v in c.logprobs.token_logprobs]
    assert tokens == lp.tokens and values[0] is None
    assert values[1:] == pytest.approx(lp.token_logprobs[1:], abs=TOL)


def choice_of(out):
    assert len(out.choices) == 1
    return out.choices[0]


def test_completions_max_tokens_0_with_echo_scores_the_prompt(client, model, offline):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, **GREEDY)
    choice = choice_of(out)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == len(offline.prompt_token_ids)
    _check_echoed(choice.logprobs, offline, "")
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0,
                                            stream=True, **GREEDY))
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in streamed) == PROMPT
    assert [t for c in streamed if c.logprobs for t in c.logprobs.tokens] == choice.logprobs.tokens
    assert streamed[-1].finish_reason == "length"


def test_max_tokens_0_without_echo_is_a_400(server):
    import httpx

    r = httpx.post(server.base_url + "/completions", json={"prompt": PROMPT, "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_completions_prompt_logprobs_field_as_vllm_gives_it(server, offline):
    import httpx

    r = httpx.post(server.base_url + "/completions", timeout=120,
                   json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["logprobs"] is None and choice["text"] and not choice["text"].startswith(PROMPT)
    got, ids = choice["prompt_logprobs"], offline.prompt_token_ids
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        expected = offline.prompt_logprobs[i]
        assert {int(t) for t in got[i]} == set(expected)
        for t, entry in got[i].items():
            want = expected[int(t)]
            assert entry["rank"] == want.rank and entry["decoded_token"] == want.decoded_token
            assert entry["logprob"] == pytest.approx(want.logprob, abs=TOL)


def test_echo_with_logprobs_for_several_prompts_and_n(client, model):
    prompts = [PROMPT, "One, two,"]
    out = client.completions.create(model=model, prompt=prompts, n=2, max_tokens=2, echo=True, logprobs=0,
                                    temperature=0.8, seed=1)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    for c in out.choices:
        prompt = prompts[c.index // 2]
        lp = c.logprobs
        assert c.text.startswith(prompt) and "".join(lp.tokens) == c.text
        assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
        assert all(t is None for t in lp.top_logprobs)  # logprobs=0: no alternatives
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
