"""logit_bias, allowed_token_ids and bad_words in the batched sampler, against a naive
per-row loop; and the fast path stays free of them when no row asks."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.errors import RequestError
from pagedserve.sample.sampler import Sampler, SamplingRow
from pagedserve.sample.sampling_ops import apply_logits_processors
from pagedserve.sample.sampling_tensors import build_sampling_batch
from pagedserve.sampling_params import SamplingParams
from ops_testing import DEVICES

VOCAB = 40
NEG_INF = float("-inf")


def naive(logits: list[float], params: SamplingParams, output: list[int]) -> list[float]:
    row = list(logits)
    if params.allowed_token_ids is not None:
        row = [x if t in params.allowed_token_ids else NEG_INF for t, x in enumerate(row)]
    for word in params.bad_words_token_ids or ():
        prefix = word[:-1]
        if not prefix or output[len(output) - len(prefix):] == prefix and len(output) >= len(prefix):
            row[word[-1]] = NEG_INF
    for t, b in (params.logit_bias or {}).items():
        row[t] += b
    return row


def with_bad_words(params: SamplingParams, sequences: list[list[int]]) -> SamplingParams:
    params.bad_words_token_ids = sequences  # what the engine sets from its tokenizer
    return params


def random_rows(rng: random.Random, num_rows: int) -> list[SamplingRow]:
    rows = []
    for _ in range(num_rows):
        kind = rng.randrange(5)
        kw = {}
        if kind in (1, 4):
            kw["logit_bias"] = {rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randrange(1, 6))}
        if kind in (2, 4):
            kw["allowed_token_ids"] = rng.sample(range(VOCAB), rng.randrange(1, 8))
        if kind in (3, 4):
            kw["bad_words"] = ["w"]
        params = SamplingParams(temperature=0.0, **kw)
        output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 4))]
        if kind in (3, 4):
            seqs = [[rng.randrange(VOCAB)]]
            seqs.append(output[-1:] + [rng.randrange(VOCAB)] if output else [rng.randrange(VOCAB), 5])
            seqs.append([rng.randrange(VOCAB), rng.randrange(VOCAB), rng.randrange(VOCAB)])
            with_bad_words(params, seqs)
        rows.append(SamplingRow(params, 1, [1, 2], output))
    return rows


@pytest.mark.parametrize("device", DEVICES)
def test_processors_match_a_naive_loop(device):
    rng = random.Random(0)
    for trial in range(30):
        rows = random_rows(rng, rng.randrange(1, 7))
        logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(trial))
        batch = build_sampling_batch(rows, VOCAB, [3], torch.device(device))
        if not any(r.params.has_logits_processors for r in rows):
            assert batch.processors is None
            continue
        got = apply_logits_processors(logits.to(device), batch.processors).cpu()
        for i, row in enumerate(rows):
            want = torch.tensor(naive(logits[i].tolist(), row.params, list(row.output_token_ids)))
            torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_tokens_respect_the_processors(device):
    sampler = Sampler(device, VOCAB, [3], seed=0)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)).to(device)
    allowed = SamplingParams(temperature=1.0, allowed_token_ids=[7, 9, 11])
    forced = SamplingParams(temperature=0.0, logit_bias={"17": 100})
    banned = with_bad_words(SamplingParams(temperature=0.0, bad_words=["x"]), [[int(logits[2].argmax())]])
    plain = SamplingParams(temperature=0.0)
    rows = [SamplingRow(allowed, 1, [1], []), SamplingRow(forced, 1, [1], []),
            SamplingRow(banned, 1, [1], []), SamplingRow(plain, 1, [1], [])]
    for _ in range(20):
        ids = sampler(logits, rows).token_ids
        assert ids[0] in (7, 9, 11)
        assert ids[1] == 17
        assert ids[2] != int(logits[2].argmax())
        assert ids[3] == int(logits[3].argmax())


def test_multi_token_bad_word_is_banned_only_after_its_prefix():
    sampler = Sampler("cpu", VOCAB, [3], seed=0)
    logits = torch.zeros(2, VOCAB)
    logits[:, 8] = 5.0  # the argmax, the bad word's last token
    params = with_bad_words(SamplingParams(temperature=0.0, bad_words=["ab"]), [[4, 8]])
    rows = [SamplingRow(params, 1, [1], [2, 4]), SamplingRow(params, 1, [1], [4, 2])]
    assert sampler(logits, rows).token_ids[0] != 8
    assert sampler(logits, rows).token_ids[1] == 8


def test_rows_without_processors_keep_the_fast_path(monkeypatch):
    sampler = Sampler("cpu", VOCAB, [3], seed=0)
    rows = [SamplingRow(SamplingParams(temperature=0.0), 1, [1], [])]
    assert sampler._is_plain_temperature(rows)
    assert build_sampling_batch(rows, VOCAB, [3], torch.device("cpu")).processors is None
    assert not sampler._is_plain_temperature([SamplingRow(SamplingParams(logit_bias={1: 1.0}), 1, [1], [])])


@pytest.mark.parametrize("kw, field", [
    (dict(logit_bias={"a": 1}), "logit_bias"), (dict(logit_bias={1: 100.5}), "logit_bias"),
    (dict(logit_bias={-1: 1}), "logit_bias"), (dict(logit_bias={1: float("nan")}), "logit_bias"),
    (dict(logit_bias=[1]), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"), (dict(allowed_token_ids=["1"]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"), (dict(bad_words=[3]), "bad_words"),
])
def test_construction_refuses_bad_values_naming_the_field(kw, field):
    with pytest.raises(RequestError) as info:
        SamplingParams(**kw)
    assert info.value.field == field


def test_logit_bias_keys_may_be_strings_and_ranges_are_inclusive():
    p = SamplingParams(logit_bias={"5": -100, 6: 100}, allowed_token_ids=(1, 2), bad_words="word")
    assert p.logit_bias == {5: -100.0, 6: 100.0} and p.allowed_token_ids == [1, 2] and p.bad_words == ["word"]
    assert p.has_logits_processors and not SamplingParams().has_logits_processors


# ---------------------------------------------------------------------------- offline LLM, default model
@pytest.fixture(scope="module")
def llm(default_model_path):
    from pagedserve import LLM

    return LLM(str(default_model_path), dtype="float32", device="cpu", seed=0, max_model_len=256)


PROMPT = "The capital of France is"


def greedy_ids(llm, **kw) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, **kw)
    return list(llm.generate([PROMPT], params)[0].outputs[0].token_ids)


def test_llm_applies_logit_bias_allowed_token_ids_and_bad_words(llm):
    plain = greedy_ids(llm)
    assert greedy_ids(llm, logit_bias={str(plain[0] + 1): 100}) == [plain[0] + 1] * 6
    allowed = [plain[1], 42, 1234]
    out = greedy_ids(llm, allowed_token_ids=allowed)
    assert set(out) <= set(allowed)
    first_word = llm.get_tokenizer().decode([plain[0]]).strip()
    banned = greedy_ids(llm, bad_words=[first_word])
    assert plain[0] not in banned and banned != plain
    text = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, bad_words=[first_word]))[0]
    assert first_word not in text.outputs[0].text.split()


@pytest.mark.parametrize("kw, field", [(dict(logit_bias={10**6: 1.0}), "logit_bias"),
                                       (dict(allowed_token_ids=[1, 10**6]), "allowed_token_ids")])
def test_llm_refuses_token_ids_outside_the_vocabulary(llm, kw, field):
    with pytest.raises(RequestError) as info:
        llm.generate([PROMPT], SamplingParams(max_tokens=2, **kw))
    assert info.value.field == field and "vocabulary" in str(info.value)


def test_llm_chat_takes_the_template_options(llm):
    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% if enable_thinking %} <think>{% endif %}{% endif %}")
    user = [{"role": "user", "content": "Hi"}]
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=1)
    out = llm.chat(user, params, chat_template=template, chat_template_kwargs={"enable_thinking": True})[0]
    assert tok.decode(out.prompt_token_ids) == "user: Hi\nassistant: <think>"
    out = llm.chat(user + [{"role": "assistant", "content": "Hello there"}], params, chat_template=template,
                   add_generation_prompt=False, continue_final_message=True)[0]
    assert tok.decode(out.prompt_token_ids) == "user: Hi\nassistant: Hello there"
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(user, params, continue_final_message=True, add_generation_prompt=False)
