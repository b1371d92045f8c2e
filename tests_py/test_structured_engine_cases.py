"""Grammar-constrained outputs stay valid through the engine's harder paths (default model, CPU):
preemption of sampled forks, chunked prefill, prefix-cache hits under another schema, n > 1, stop
strings, max_tokens reached mid-structure and EOS wanted early. test_structured_outputs.py has the
plain cases (greedy preemption, prefix caching of one schema, ...); these add what it does not.

Outputs are checked with jsonschema, and partial ones by replaying their tokens through a fresh
matcher of the same grammar (every token accepted, the grammar not yet complete)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from pagedserve import LLM, SamplingParams, StructuredOutputsParams

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
PET = {"type": "object", "properties": {"animal": {"enum": ["cat", "dog", "bird"]},
                                       "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
       "required": ["animal", "legs"], "additionalProperties": False}
PROMPT = "Answer with JSON only. Describe an example record:\n"


def _params(schema: dict, **kw) -> SamplingParams:
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    return SamplingParams(structured_outputs=so, **{"max_tokens": 48, "temperature": 0.0, **kw})


@pytest.fixture(scope="module")
def llm(default_model_path):
    return LLM(str(default_model_path), dtype="float32", device="cpu", seed=0, max_model_len=512)


@pytest.fixture(scope="module")
def tight(default_model_path):
    """A KV pool of 384 tokens and a 32-token step budget: concurrent requests with long prompts get
    preempted, and a long prompt is prefilled in chunks."""
    return LLM(str(default_model_path), dtype="float32", device="cpu", seed=0, max_model_len=384,
               num_kv_blocks=96, block_size=4, max_num_batched_tokens=32, max_num_seqs=16,
               enable_prefix_caching=False)


def _replay(llm, schema: dict, token_ids: list[int]):
    """A fresh matcher of the schema's grammar after `token_ids` (asserting each was accepted)."""
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    matcher = llm.llm_engine.grammars.compile(spec).new_matcher()
    for token in token_ids:
        assert matcher.accept_token(token), token_ids
    return matcher


def _eos_allowed(llm, matcher) -> bool:
    vocab = llm.llm_engine.grammars.vocab_size
    bitmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    matcher.fill_next_token_bitmask(bitmask, 0)
    eos = llm.llm_engine.eos_token_ids[0]
    return bool((int(bitmask[0, eos // 32]) >> (eos % 32)) & 1)


def _valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_preempted_sampled_forks_stay_valid(tight):
    """n = 2 sampled forks of several requests, preempted and recomputed: each matcher keeps its own state."""
    outs = tight.generate([PROMPT * 9] * 4, _params(PERSON, n=2, temperature=0.9, seed=5, max_tokens=32),
                          use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    texts = set()
    for out in outs:
        assert len(out.outputs) == 2
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            _valid(c.text, PERSON)
            texts.add(c.text)
    assert len(texts) > 1


def test_chunked_prefill_long_prompt(llm, tight):
    """A prompt several times the step budget is prefilled in chunks; the constrained output is valid and
    equals the one of an engine that prefills it at once (greedy)."""
    prompt = "Here is a list of pets and their legs, one JSON record per line.\n" * 8 + PROMPT
    chunked = tight.generate([prompt], _params(PET), use_tqdm=False)[0]
    assert len(chunked.prompt_token_ids) > 4 * 32
    whole = llm.generate([prompt], _params(PET), use_tqdm=False)[0]
    assert chunked.outputs[0].finish_reason == "stop"
    _valid(chunked.outputs[0].text, PET)
    assert chunked.outputs[0].text == whole.outputs[0].text


def test_n_samples_all_valid_and_different(llm):
    out = llm.generate([PROMPT], _params(PERSON, n=4, temperature=1.0, seed=11), use_tqdm=False)[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        _valid(c.text, PERSON)
    assert len({c.text for c in out.outputs}) > 1


def test_prefix_cache_hit_under_another_schema(llm):
    """The cached prompt carries no grammar state: a second request on it follows its own schema."""
    prompt = PROMPT * 4
    first = llm.generate([prompt], _params(PERSON), use_tqdm=False)[0]
    second = llm.generate([prompt], _params(PET), use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    _valid(first.outputs[0].text, PERSON)
    _valid(second.outputs[0].text, PET)


def test_stop_string_inside_the_structure(llm):
    """A stop string ends the output before the grammar completes: finish "stop", the text cut before it,
    every token one the grammar accepted."""
    out = llm.generate([PROMPT], _params(PERSON, stop=['"age"']), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == '"age"'
    assert out.text.startswith('{"name":') and '"age"' not in out.text
    matcher = _replay(llm, PERSON, out.token_ids)
    assert not matcher.is_terminated()


def test_max_tokens_mid_structure_is_a_grammar_prefix(llm):
    out = llm.generate([PROMPT], _params(PERSON, max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    matcher = _replay(llm, PERSON, out.token_ids)
    assert not matcher.is_terminated() and not _eos_allowed(llm, matcher)


def test_eos_only_where_the_grammar_accepts(llm):
    """EOS pushed to the top (+100 bias) ends a free output at once, but a constrained one only where the
    JSON is complete: the mask comes before the bias."""
    eos = llm.llm_engine.eos_token_ids[0]
    free = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0, logit_bias={eos: 100.0}),
                        use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "stop" and free.text == ""
    out = llm.generate([PROMPT], _params(PET, logit_bias={eos: 100.0}), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    _valid(out.text, PET)
    tokens = [t for t in out.token_ids if t != eos]
    spec = StructuredOutputsParams(json=PET, disable_any_whitespace=True)
    matcher = llm.llm_engine.grammars.compile(spec).new_matcher()
    for token in tokens:  # EOS was forbidden at every step before the JSON closed
        assert not _eos_allowed(llm, matcher)
        assert matcher.accept_token(token)
    assert _eos_allowed(llm, matcher)
