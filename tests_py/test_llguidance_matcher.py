"""llguidance's C API as the engine calls it (pagedserve._core.grammar: cpp/grammar/), against llguidance's own
Python matcher as the oracle: the same masks and accepts along random walks of allowed tokens, under the kinds of
grammar the engine gives llguidance; and the GrammarPool that runs a step's accepts and masks over threads."""

from __future__ import annotations

import random
from copy import copy

import numpy as np
import pytest
import torch

llguidance = pytest.importorskip("llguidance")
import llguidance._lib  # noqa: E402
import llguidance.hf  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from pagedserve import StructuredOutputsParams  # noqa: E402
from pagedserve._core import grammar as core  # noqa: E402
from pagedserve.engine.grammar_backends import LLGuidanceBackend  # noqa: E402

SPECS = {
    "json schema": StructuredOutputsParams(json={
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}}},
        "required": ["name", "age"]}),
    "compact json": StructuredOutputsParams(json={"type": "array", "items": {"type": "number"}},
                                            disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=r"(yes|no|maybe [0-9]{1,3})\.?"),
    "grammar": StructuredOutputsParams(grammar='root ::= "(" item ("," item)* ")"\nitem ::= [a-z]+ | [0-9]+'),
}
PAD = 64  # the model's rows past the tokenizer's vocabulary (as Qwen's 151,936 over 151,665)


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_path):
    return AutoTokenizer.from_pretrained(str(default_model_path), local_files_only=True)


@pytest.fixture(scope="module")
def vocab(hf_tokenizer) -> int:
    return len(hf_tokenizer) + PAD


def tokenizer_json(hf_tokenizer) -> str:
    backend = copy(hf_tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


@pytest.fixture(scope="module")
def eos_ids(hf_tokenizer) -> list[int]:
    """Two: the tokenizer's own and another special token (which one is the EOS differs across transformers)."""
    eos = hf_tokenizer.eos_token_id
    return [eos, next(t for t in (0, 1, 2) if t != eos)]


@pytest.fixture(scope="module")
def c_tokenizer(hf_tokenizer, vocab, eos_ids):
    py = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab, eos_token=eos_ids)
    return core.LlgTokenizer(llguidance._lib.__file__, tokenizer_json(hf_tokenizer), vocab, eos_ids, py.tokenize_bytes)


@pytest.fixture(scope="module")
def py_tokenizer(hf_tokenizer, vocab, eos_ids):
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab, eos_token=eos_ids)


def mask_bits(words: torch.Tensor, vocab: int) -> list[int]:
    """The tokens a mask row allows (bit t % 32 of word t // 32)."""
    bits = np.unpackbits(words.contiguous().numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab]).tolist()


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_masks_and_accepts_equal_llguidance_python_matcher(kind, c_tokenizer, py_tokenizer, vocab, eos_ids):
    grammar = LLGuidanceBackend.grammar_text(SPECS[kind])
    words = (vocab + 31) // 32
    rng = random.Random(kind)
    for walk in range(3):
        c, py = core.LlgMatcher(c_tokenizer, grammar), llguidance.LLMatcher(py_tokenizer, grammar, log_level=0)
        assert c.error is None and not py.is_error()
        c_mask, py_mask = torch.zeros(words, dtype=torch.int32), torch.zeros(words, dtype=torch.int32)
        for step in range(60):
            c.fill(c_mask.data_ptr(), words)
            py.unsafe_compute_mask_ptr(py_mask.data_ptr(), words * 4)
            assert torch.equal(c_mask, py_mask), f"walk {walk}, step {step}"
            allowed = mask_bits(py_mask, vocab)
            assert allowed
            refused = rng.randrange(vocab)
            assert c.accepts(refused) == (refused in allowed) == (py.validate_tokens([refused]) == 1)
            token = rng.choice(allowed)
            assert c.consume(token) == py.consume_token(token) is True
            assert c.is_stopped() == py.is_stopped()
            if c.is_stopped():
                c.fill(c_mask.data_ptr(), words)  # a stopped matcher allows its EOS ids alone
                assert mask_bits(c_mask, vocab) == sorted(eos_ids)
                assert c.consume(eos_ids[1]) and c.error is None  # ... and takes one without moving
                break


def test_refused_token_puts_the_matcher_in_error(c_tokenizer, vocab, eos_ids):
    matcher = core.LlgMatcher(c_tokenizer, LLGuidanceBackend.grammar_text(SPECS["regex"]))
    twin = matcher.clone()
    x = c_tokenizer.vocab_size - PAD - 1  # some token no answer starts with
    assert not matcher.accepts(x) and matcher.error is None  # asking moves nothing
    assert not matcher.consume(x)
    assert matcher.is_error() and matcher.is_stopped() and matcher.error
    words = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    matcher.fill(words.data_ptr(), words.numel())
    assert mask_bits(words, vocab) == sorted(eos_ids)
    assert twin.error is None and twin.consume(c_tokenizer_id(twin, vocab))  # the clone kept its own state


def c_tokenizer_id(matcher, vocab: int) -> int:
    words = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    matcher.fill(words.data_ptr(), words.numel())
    return mask_bits(words, vocab)[0]


def test_compile_errors_and_bad_inputs(c_tokenizer, hf_tokenizer, vocab, eos_ids):
    broken = core.LlgMatcher(c_tokenizer, llguidance.LLMatcher.grammar_from_regex("(unclosed"))
    assert broken.is_error() and broken.error
    with pytest.raises(ValueError, match="cannot load"):
        core.LlgTokenizer("/nonexistent/libllguidance.so", tokenizer_json(hf_tokenizer), vocab, eos_ids)
    with pytest.raises(ValueError, match="tokenizer"):
        core.LlgTokenizer(llguidance._lib.__file__, "{not json", vocab, eos_ids)
    with pytest.raises(ValueError, match="EOS"):
        core.LlgTokenizer(llguidance._lib.__file__, tokenizer_json(hf_tokenizer), vocab, [])
    matcher = core.LlgMatcher(c_tokenizer, LLGuidanceBackend.grammar_text(SPECS["regex"]))
    with pytest.raises(RuntimeError, match="words"):
        matcher.fill(torch.zeros(8, dtype=torch.int32).data_ptr(), 8)


def walk_matchers(c_tokenizer, vocab: int, rows: int, seed: int) -> tuple[list, list[list[int]]]:
    """`rows` matchers under the JSON schema, each 0-5 random allowed tokens in, and up to 12 allowed tokens
    each takes next (found on a clone)."""
    template = core.LlgMatcher(c_tokenizer, LLGuidanceBackend.grammar_text(SPECS["json schema"]))
    rng, matchers, plans = random.Random(seed), [], []
    for _ in range(rows):
        m = template.clone()
        for _ in range(rng.randrange(6)):
            assert m.consume(rng.choice(mask_bits_of(m, vocab)))
        scout, plan = m.clone(), []
        while len(plan) < 12 and not scout.is_stopped():
            plan.append(rng.choice(mask_bits_of(scout, vocab)))
            assert scout.consume(plan[-1])
        matchers.append(m)
        plans.append(plan)
    return matchers, plans


def mask_bits_of(matcher, vocab: int) -> list[int]:
    words = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    matcher.fill(words.data_ptr(), words.numel())
    return mask_bits(words, vocab)


@pytest.mark.parametrize("threads", [2, 4])
def test_pool_equals_one_matcher_at_a_time(threads, c_tokenizer, vocab):
    rows, words = 24, (vocab + 31) // 32
    pooled, plans = walk_matchers(c_tokenizer, vocab, rows, seed=threads)
    alone = [m.clone() for m in pooled]
    pool = core.GrammarPool(threads)
    assert pool.num_threads == threads
    flag = torch.zeros(2, dtype=torch.int64)
    out_rows = [(5 * i + 3) % 32 for i in range(rows)]  # scattered, some rows of the bitmask unused
    for step in range(12):
        tokens = [plan[step] if step < len(plan) else 0 for plan in plans]  # 0 past a plan: refused, as alone
        bitmask = torch.full((32, words), -1, dtype=torch.int32)
        outcomes = pool.run(pooled, tokens, out_rows, bitmask.data_ptr(), 32, words, flag.data_ptr(), step + 1)
        assert flag[0] == step + 1
        for i, m in enumerate(alone):
            took = m.consume(tokens[i])
            assert outcomes[i] == outcome(took, m), f"row {i}, step {step}"
            assert mask_bits(bitmask[out_rows[i]], vocab) == mask_bits_of(m, vocab), f"row {i}, step {step}"
        untouched = sorted(set(range(32)) - set(out_rows))
        assert (bitmask[untouched] == -1).all()


def outcome(took: bool, matcher) -> int:
    pool = core.GrammarPool
    return pool.REFUSED if not took else pool.STOPPED if matcher.is_stopped() else pool.LIVE


def test_pool_outcomes(c_tokenizer, hf_tokenizer, vocab):
    """A row that stops, one that refuses its token and one that goes on, told apart by the pool."""
    grammar = LLGuidanceBackend.grammar_text(SPECS["regex"])
    yes, maybe = (hf_tokenizer.encode(word, add_special_tokens=False) for word in ("yes.", "maybe"))
    refused = c_tokenizer.vocab_size - PAD - 1  # as in test_refused_token_puts_the_matcher_in_error
    matchers = [core.LlgMatcher(c_tokenizer, grammar) for _ in range(3)]
    for token in yes[:-1]:
        assert matchers[0].consume(token)
    words = (vocab + 31) // 32
    bitmask = torch.zeros((3, words), dtype=torch.int32)
    got = core.GrammarPool(2).run(matchers, [yes[-1], refused, maybe[0]], [0, 1, 2], bitmask.data_ptr(), 3, words)
    assert list(got) == [core.GrammarPool.STOPPED, core.GrammarPool.REFUSED, core.GrammarPool.LIVE]


def test_pool_fills_without_tokens_and_raises_the_flag_on_error(c_tokenizer, vocab):
    words = (vocab + 31) // 32
    matchers, _ = walk_matchers(c_tokenizer, vocab, 4, seed=7)
    pool = core.GrammarPool(2)
    bitmask = torch.zeros((4, words), dtype=torch.int32)
    assert list(pool.run(matchers, None, [3, 2, 1, 0], bitmask.data_ptr(), 4, words)) == [core.GrammarPool.LIVE] * 4
    for i, m in enumerate(matchers):
        assert mask_bits(bitmask[3 - i], vocab) == mask_bits_of(m, vocab)
    flag = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="row 4 outside"):
        pool.run(matchers, None, [0, 1, 2, 4], bitmask.data_ptr(), 4, words, flag.data_ptr(), 9)
    assert flag[0] == 9  # a device waiting for this job is let go; the engine reports the error


def test_forced_text_takes_the_model_tokenizers_tokens(hf_tokenizer, vocab, eos_ids, c_tokenizer):
    """After '{"' under a schema whose only key is "name", llguidance allows the forced text's own first
    token; tokenizing greedily (no tokenize function given) it would also allow "n", "na" and "nam"."""
    greedy = core.LlgTokenizer(llguidance._lib.__file__, tokenizer_json(hf_tokenizer), vocab, eos_ids)
    grammar = LLGuidanceBackend.grammar_text(StructuredOutputsParams(json={
        "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}))
    ids = {text: hf_tokenizer.convert_tokens_to_ids(text) for text in ("n", "na", "nam")}
    masks = {}
    for name, tokenizer in (("model's", c_tokenizer), ("greedy", greedy)):
        matcher = core.LlgMatcher(tokenizer, grammar)
        for token in hf_tokenizer.encode('{"', add_special_tokens=False):
            assert matcher.consume(token)
        masks[name] = set(mask_bits_of(matcher, vocab))
    assert hf_tokenizer.convert_tokens_to_ids("name") in masks["model's"]
    assert not masks["model's"] & set(ids.values())
    assert set(ids.values()) <= masks["greedy"]


def test_each_forced_text_is_tokenized_once(hf_tokenizer, vocab, eos_ids):
    """The tokens of a forced text are kept: Python's tokenizer (under the GIL) runs once a text, not each
    time a pool thread's mask needs it."""
    py = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab, eos_token=eos_ids)
    asked = []
    tokenizer = core.LlgTokenizer(llguidance._lib.__file__, tokenizer_json(hf_tokenizer), vocab, eos_ids,
                                  lambda text: asked.append(text) or py.tokenize_bytes(text))
    grammar = LLGuidanceBackend.grammar_text(StructuredOutputsParams(json={
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}, disable_any_whitespace=True))
    for _ in range(3):  # the same walk three times: the same forced texts
        matcher = core.LlgMatcher(tokenizer, grammar)
        for token in hf_tokenizer.encode('{"a": 1, "b": 2}', add_special_tokens=False):
            mask_bits_of(matcher, vocab)
            assert matcher.consume(token)
    assert asked and len(asked) == len(set(asked))
