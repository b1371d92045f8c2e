"""The LLM / LLMEngine API on the default model: prompt forms, sampling options,
parallel sampling, stop rules, logprobs, chat, errors and aborts."""

import math
import subprocess
import sys

import pytest

from pagedserve import LLM, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def llm(default_model_path):
    return LLM(str(default_model_path), dtype="float32", device="cpu", seed=0, max_model_len=1024)


def text(out, i=0):
    return out.outputs[i].text


def test_prompt_forms_give_the_same_greedy_output(llm):
    tok = llm.get_tokenizer()
    p = SamplingParams(temperature=0, max_tokens=8)
    ids = tok("The capital of France is").input_ids
    a, b, c = llm.generate(["The capital of France is", ids, {"prompt_token_ids": ids}], p, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    assert "Paris" in text(a)
    assert a.prompt == "The capital of France is" and a.prompt_token_ids == ids
    assert a.finished and a.outputs[0].finish_reason == "length"
    assert a.metrics.time_to_first_token is not None and a.metrics.time_to_first_token > 0


def test_outputs_come_back_in_prompt_order_with_per_prompt_params(llm):
    prompts = ["1, 2, 3, 4,", "The capital of France is", "Hello"]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (3, 5, 7)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5, 7]


def test_seed_reproducible_whatever_else_is_in_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234)
    alone = llm.generate("Once upon a time", seeded, use_tqdm=False)[0]
    noise = SamplingParams(temperature=1.0, max_tokens=12)
    batch = llm.generate(["Tell me a story", "Once upon a time", "Why is the sky blue?"],
                         [noise, seeded, noise], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    other_seed = llm.generate("Once upon a time", SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=9),
                              use_tqdm=False)[0]
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


def test_parallel_sampling_returns_n_distinct_completions(llm):
    out = llm.generate("Write a word:", SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=3),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate("Write a word:", SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=3),
                         use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    greedy = llm.generate("Write a word:", SamplingParams(n=2, temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids, "greedy forks agree"


def test_stop_strings_cut_the_text(llm):
    p = SamplingParams(temperature=0, max_tokens=40, stop=["Paris"])
    out = llm.generate("The capital of France is", p, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "Paris"
    assert "Paris" not in text(out)
    p = SamplingParams(temperature=0, max_tokens=40, stop=["Paris"], include_stop_str_in_output=True)
    assert text(llm.generate("The capital of France is", p, use_tqdm=False)[0]).endswith("Paris")


def test_stop_token_ids_and_eos(llm):
    tok = llm.get_tokenizer()
    free = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    second = free.outputs[0].token_ids[1]
    p = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[second])
    out = llm.generate("The capital of France is", p, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free.outputs[0].token_ids[:2]
    assert out.finish_reason == "stop" and out.stop_reason == second
    chat = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=200),
                    use_tqdm=False)[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.stop_reason is None  # EOS
    assert chat.token_ids[-1] in {tok.eos_token_id, *tok.convert_tokens_to_ids(["<|im_end|>"])}


def test_min_tokens_and_ignore_eos_keep_generating(llm):
    p = SamplingParams(temperature=0, max_tokens=30, min_tokens=30)
    out = llm.chat([{"role": "user", "content": "Say hi."}], p, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 30 and out.finish_reason == "length"


def test_logprobs_are_consistent(llm):
    p = SamplingParams(temperature=0, max_tokens=5, logprobs=3)
    out = llm.generate("The capital of France is", p, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry
        assert entry[token].rank == 1, "greedy picks the top token"
        assert len(entry) >= 3
        best = max(lp.logprob for lp in entry.values())
        assert entry[token].logprob == pytest.approx(best)
        assert entry[token].logprob <= 0
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert math.isfinite(out.cumulative_logprob)


def test_chat_applies_the_template(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert "<|im_start|>" in tok.decode(out.prompt_token_ids)
    assert "Paris" in text(out)


def test_too_long_request_is_a_clear_error_and_disturbs_nothing(llm):
    engine = llm.llm_engine
    engine.add_request("ok", "Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=8))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("too-long", "hi", SamplingParams(max_tokens=5000))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("bad-token", [10**9], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", "again", SamplingParams())
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    final = [o for o in outs if o.finished]
    assert [o.request_id for o in final] == ["ok"]
    reference = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert "".join(o.outputs[0].text for o in outs) == text(reference)


def test_abort_releases_everything(llm):
    engine = llm.llm_engine
    for i in range(4):
        engine.add_request(f"a{i}", "Tell me a long story about a dragon.", SamplingParams(max_tokens=200, n=2))
    for _ in range(3):
        engine.step()
    assert engine.stats()["num_running"] > 0
    engine.abort_request([f"a{i}" for i in range(4)])
    assert not engine.has_unfinished_requests()
    s = engine.stats()
    assert s["num_running"] == 0 and s["num_waiting"] == 0
    assert s["num_free_blocks"] == s["num_blocks"]


def test_step_returns_deltas(llm):
    engine: LLMEngine = llm.llm_engine
    engine.add_request("d", "The capital of France is", SamplingParams(temperature=0, max_tokens=6))
    pieces, finished = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.outputs[0].token_ids)
            if out.finished:
                finished = out
    assert all(len(p) == 1 for p in pieces) and len(pieces) == 6
    assert finished is not None and finished.outputs[0].finish_reason == "length"


def test_cli_generate_prints_text(default_model_path):
    result = subprocess.run([sys.executable, "-m", "pagedserve.cli", "generate", "The capital of France is",
                             "--max-tokens", "8", "--device", "cpu", "--model", str(default_model_path)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The capital of France is") and "Paris" in result.stdout
    assert "tok/s" in result.stderr
    help_text = subprocess.run([sys.executable, "-m", "pagedserve.cli", "generate", "--help"],
                               capture_output=True, text=True, timeout=60).stdout
    for flag in ("--max-tokens", "--temperature", "--top-p", "--seed", "--n", "--model"):
        assert flag in help_text


def test_cli_chat_answers_and_keeps_the_conversation(default_model_path):
    script = "What is the capital of France?\nAnd of Germany?\n/exit\n"
    result = subprocess.run([sys.executable, "-m", "pagedserve.cli", "chat", "--max-tokens", "24", "--device", "cpu",
                             "--model", str(default_model_path)], input=script, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    answers = [line for line in result.stdout.split("> ") if line.strip()]
    assert len(answers) == 2, result.stdout
    assert "Paris" in answers[0]
    assert "/exit" in result.stderr or "quits" in result.stderr  # the banner explains how to leave


def test_generate_and_chat_without_params_use_the_model_defaults(llm, monkeypatch):
    engine = llm.llm_engine
    seen = []
    add_request = engine.add_request

    def spy(request_id, prompt, params=None, **kwargs):
        seen.append(params)
        return add_request(request_id, prompt, params, **kwargs)

    monkeypatch.setattr(engine, "add_request", spy)
    llm.generate("Hi", use_tqdm=False)
    llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)
    defaults = engine.info().default_sampling
    assert defaults  # DEFAULT_SAMPLING under the model's generation_config.json
    for params in seen:
        assert {k: getattr(params, k) for k in defaults} == defaults


def test_llm_rejects_an_unknown_option_by_name():
    with pytest.raises(TypeError, match="max_num_sequence"):
        LLM(max_num_sequence=4)
