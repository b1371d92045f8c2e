"""The whole engine on the default model (SmolLM2-135M-Instruct, float32, CPU)
against transformers' greedy generate: token-identical, and unchanged by
batching, prefix caching, chunked prefill and preemption."""

import pytest
import torch

from pagedserve import LLM, SamplingParams

NEW_TOKENS = 32

PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
]
CHAT_QUESTIONS = [
    "What is the boiling point of water in Celsius?",
    "Write a short poem about the moon.",
]


def long_prompt(num_facts: int) -> str:
    facts = [f"Fact {i}: the number {i} squared is {i * i}, and its double is {2 * i}." for i in range(1, num_facts)]
    return " ".join(facts) + " Summary of the facts above:"


@pytest.fixture(scope="module")
def hf(default_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def prompts(hf):
    tok, _ = hf
    ids = [tok(p).input_ids for p in PLAIN_PROMPTS]
    ids.append(tok(long_prompt(12)).input_ids)
    ids.append(tok(long_prompt(20)).input_ids)  # several hundred tokens
    for q in CHAT_QUESTIONS:
        ids.append(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
    assert len(ids) >= 8 and max(len(i) for i in ids) > 300
    return ids


@pytest.fixture(scope="module")
def hf_greedy(hf, prompts):
    tok, model = hf
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=tok.eos_token_id)
            outs.append(gen[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module")
def llm(default_model_path):
    return LLM(str(default_model_path), dtype="float32", device="cpu", seed=0)


# min_tokens masks EOS exactly as transformers' min_new_tokens does.
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_is_token_identical_to_transformers(llm, prompts, hf_greedy):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for got, want, ids in zip(token_ids(outs), hf_greedy, prompts):
        assert got == want, f"prompt of {len(ids)} tokens diverged"


def test_alone_equals_batched_with_fifteen_others(llm, prompts, hf_greedy):
    alone = token_ids(llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, use_tqdm=False))[0]
    batch = [{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(16)]
    together = token_ids(llm.generate(batch, GREEDY, use_tqdm=False))
    assert alone == together[0] == hf_greedy[0]
    for i, got in enumerate(together):
        assert got == hf_greedy[i % len(prompts)]


@pytest.mark.parametrize("options", [
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=64, max_num_seqs=16),  # long prompts split into many chunks
    dict(num_kv_blocks=48, max_model_len=560),  # a pool too small for the batch: forced preemption
], ids=["no-prefix-cache", "chunked-prefill", "preemption"])
def test_greedy_outputs_survive_engine_features(default_model_path, prompts, hf_greedy, options):
    llm = LLM(str(default_model_path), dtype="float32", device="cpu", **options)
    batch = [{"prompt_token_ids": p} for p in prompts] * 2
    outs = token_ids(llm.generate(batch, GREEDY, use_tqdm=False))
    for i, got in enumerate(outs):
        assert got == hf_greedy[i % len(prompts)]
    stats = llm.llm_engine.stats()
    if "num_kv_blocks" in options:
        assert stats["num_preemptions"] > 0, "the pool was meant to force preemption"
    assert stats["num_free_blocks"] == stats["num_blocks"], "every block returns to the pool"


def test_prefix_cache_hits_on_a_repeated_prompt(llm, prompts, hf_greedy):
    before = llm.llm_engine.stats()["prefix_hit_blocks"]
    out = token_ids(llm.generate({"prompt_token_ids": prompts[5]}, GREEDY, use_tqdm=False))[0]
    assert llm.llm_engine.stats()["prefix_hit_blocks"] > before
    assert out == hf_greedy[5]
