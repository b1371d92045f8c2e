"""The real server (default model, CPU) through the official `openai` client:
completions and chat, streaming and not, n = 2, seeds, stop strings and
tokens, logprobs, the vLLM extra fields, tokenize, metrics and the engine view.

Greedy text is checked against HF transformers generating from the same
weights: an oracle that shares no code with the engine or the server.
"""

from __future__ import annotations

import re

import pytest
import torch

from server_process import ServerProcess

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]
# Fields left out take the model's sampling defaults (for this model pagedserve's, repetition_penalty 1.1
# among them); plain greedy, as HF's generate and the raw logprobs know it, has no penalty.
NO_PENALTY = {"repetition_penalty": 1.0}


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-num-seqs", "8") as s:
        yield s


@pytest.fixture(scope="module")
def hf(server, default_model_path):
    """(tokenizer, model) of HF transformers over the directory the server loaded (the default model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = str(default_model_path)
    tokenizer = AutoTokenizer.from_pretrained(root)
    hf_model = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval()
    return tokenizer, hf_model


def hf_greedy(hf, prompt_ids: list[int], max_new_tokens: int) -> str:
    tokenizer, hf_model = hf
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return tokenizer.decode(out[0, len(prompt_ids):], skip_special_tokens=True)


def tokenize(server, **body) -> list[int]:
    return server.post("/tokenize", json=body).json()["tokens"]


def stream_texts(stream) -> tuple[dict[int, str], dict[int, str], object]:
    """(texts by choice, finish reasons by choice, usage) of a completions or chat stream."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usage


# ---------------------------------------------------------------------------- basics
def test_health_and_models(server, client, model):
    assert server.get("/health").status_code == 200
    models = client.models.list().data
    assert [m.id for m in models] == [model] and model == "SmolLM2-135M-Instruct"
    assert server.get("/v1/models").json()["data"][0]["max_model_len"] == 1024


def test_greedy_completion_matches_hf_transformers(server, client, model, hf):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body=NO_PENALTY)
    choice = out.choices[0]
    assert choice.text == hf_greedy(hf, tokenize(server, prompt=PROMPT), 12)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.usage.prompt_tokens == len(tokenize(server, prompt=PROMPT))
    assert out.usage.completion_tokens <= 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert choice.finish_reason == ("length" if out.usage.completion_tokens == 12 else "stop")


def test_greedy_chat_matches_hf_and_streams_the_same_text(server, client, model, hf):
    out = client.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0,
                                         extra_body=NO_PENALTY)
    ids = tokenize(server, messages=CHAT)
    message = out.choices[0].message
    assert message.role == "assistant" and message.content == hf_greedy(hf, ids, 16)
    assert out.usage.prompt_tokens == len(ids) and out.object == "chat.completion"
    stream = client.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=NO_PENALTY)
    texts, reasons, usage = stream_texts(stream)
    assert texts == {0: message.content} and reasons == {0: out.choices[0].finish_reason}
    assert usage.completion_tokens == out.usage.completion_tokens and usage.prompt_tokens == len(ids)


def test_streamed_completion_equals_the_whole_one(client, model):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0, stream=True))
    assert len(chunks) > 2, "tokens should arrive in several chunks"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_n2_seeded_sampling_is_reproducible(client, model):
    def sample(seed, stream=False):
        kw = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, n=2, seed=seed)
        if stream:
            texts, _, _ = stream_texts(client.completions.create(stream=True, **kw))
            return texts
        return {c.index: c.text for c in client.completions.create(**kw).choices}

    first = sample(1234)
    assert set(first) == {0, 1}
    assert sample(1234) == first
    assert sample(1234, stream=True) == first
    others = [sample(seed) for seed in (1, 2, 3)]
    assert any(o != first for o in others), "different seeds should give different samples"


def test_n2_chat_gives_two_choices(client, model):
    out = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, n=2, temperature=0.9, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(c.message.content for c in out.choices)
    texts, reasons, _ = stream_texts(client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, n=2,
                                                                     temperature=0.9, seed=7, stream=True))
    assert texts == {c.index: c.message.content for c in out.choices} and set(reasons) == {0, 1}


def test_stop_strings_cut_the_text(client, model):
    reference = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text
    # a stop string from the middle of the text that does not occur before it
    start = next(i for i in range(len(reference) // 3, len(reference) - 2)
                 if reference.find(reference[i:i + 2]) == i and reference[i:i + 2].strip())
    stop = reference[start:start + 2]
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "#@!"],
                                    extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.text == reference[:start]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    texts, reasons, _ = stream_texts(client.completions.create(model=model, prompt=PROMPT, max_tokens=16,
                                                               temperature=0, stop=stop, stream=True,
                                                               extra_body={"ignore_eos": True}))
    assert texts == {0: reference[:start]} and reasons == {0: "stop"}
    kept = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == reference[:start + len(stop)]


def test_extra_sampling_fields(server, client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0,
                                    extra_body={"ignore_eos": True, "min_tokens": 20, "top_k": 1,
                                                "repetition_penalty": 1.0, "min_p": 0.0})
    assert out.usage.completion_tokens == 20 and out.choices[0].finish_reason == "length"
    ids = tokenize(server, prompt=out.choices[0].text, add_special_tokens=False)
    stop_id = next(t for i, t in enumerate(ids) if i >= 2 and t not in ids[:i])
    cut = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [stop_id], **NO_PENALTY})
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].model_extra["stop_reason"] == stop_id
    assert out.choices[0].text.startswith(cut.choices[0].text)
    assert cut.usage.completion_tokens == ids.index(stop_id) + 1  # the stop token counts, its text does not


def test_penalties_change_greedy_output(client, model):
    kw = dict(model=model, prompt="one, two, one, two, one, two,", max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0].text
    penalized = client.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **kw).choices[0].text
    assert plain != penalized


def test_several_prompts_and_token_id_prompts(server, client, model):
    prompts = [PROMPT, "Once upon a time"]
    batch = client.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in batch.choices}
    for i, prompt in enumerate(prompts):
        alone = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0).choices[0].text
        assert by_index[2 * i] == by_index[2 * i + 1] == alone
    as_ids = client.completions.create(model=model, prompt=tokenize(server, prompt=PROMPT), max_tokens=6,
                                       temperature=0)
    assert as_ids.choices[0].text == by_index[0]


def test_echo_prepends_the_prompt(client, model):
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0).choices[0].text
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain


def test_completion_logprobs(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                    extra_body=NO_PENALTY)
    lp = out.choices[0].logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert sampled <= 0 and 1 <= len(top) <= 3
        assert sampled == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the most likely
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(client, model):
    out = client.chat.completions.create(model=model, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=2, extra_body=NO_PENALTY)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for item in content:
        values = [t.logprob for t in item.top_logprobs]
        assert len(values) == 2 and values == sorted(values, reverse=True)
        assert item.logprob == pytest.approx(values[0], abs=1e-4)
        assert item.bytes == list(item.token.encode())
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=5, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True, extra_body=NO_PENALTY))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_tokenize_detokenize_round_trip(server):
    body = server.post("/tokenize", json={"prompt": "Hello, paged world!"}).json()
    assert body["count"] == len(body["tokens"]) > 3 and body["max_model_len"] == 1024
    assert server.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"] == "Hello, paged world!"
    chat = server.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > body["count"]


def test_metrics_and_engine_state(server, client, model):
    before = server.metrics()
    long_prompt = "pagedserve shares KV cache blocks between requests with a common prefix. " * 8
    for _ in range(2):
        client.completions.create(model=model, prompt=long_prompt, max_tokens=3, temperature=0)
    after = server.metrics()
    for name in ("pagedserve:num_requests_running", "pagedserve:num_requests_waiting",
                 "pagedserve:kv_cache_usage_perc", "pagedserve:prefix_cache_hit_rate",
                 "pagedserve:num_preemptions_total", "pagedserve:time_to_first_token_seconds_bucket",
                 "pagedserve:time_per_output_token_seconds_bucket", "pagedserve:e2e_request_latency_seconds_bucket",
                 "pagedserve:prompt_tokens_total", "pagedserve:generation_tokens_total"):
        assert name in after, name
    assert after["pagedserve:e2e_request_latency_seconds_count"] == \
        before["pagedserve:e2e_request_latency_seconds_count"] + 2
    assert after["pagedserve:generation_tokens_total"] >= before["pagedserve:generation_tokens_total"] + 6
    assert after["pagedserve:prefix_cache_hit_rate"] > 0, "the second request should reuse cached blocks"
    state = server.wait_idle()
    assert re.fullmatch("[0-3]+", state["block_states"])
    assert len(state["block_states"]) == state["stats"]["num_blocks"] == after["pagedserve:num_kv_blocks"]
    assert "3" in state["block_states"], "finished prompts stay cached for prefix reuse"
    assert state["steps"] and state["steps"][-1]["decode_tokens"] + state["steps"][-1]["prefill_tokens"] > 0
    assert server.get("/").headers["content-type"].startswith("text/html")


def test_usage_reports_the_prompt_tokens_the_prefix_cache_held(client, model):
    prompt = "A paged KV cache keeps every sequence's keys and values in fixed-size blocks. " * 6
    first = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details is not None
    assert 16 <= cached < second.usage.prompt_tokens, "whole blocks of the prompt come from the cache"
    chat = [{"role": "user", "content": prompt + "Summarize that."}]
    client.chat.completions.create(model=model, messages=chat, max_tokens=2, temperature=0)
    streamed = list(client.chat.completions.create(model=model, messages=chat, max_tokens=2, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens >= 16
