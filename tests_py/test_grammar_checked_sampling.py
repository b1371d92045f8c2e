"""Checked grammar sampling (engine/grammar_step.py with the sampler's Gumbel-max pass): rows draw unmasked,
the grammar checks the draws, and only refused rows draw again under their masks. The oracle is the same
sampler given every row's filled mask up front: the tokens must be the same, row for row, for greedy and
temperature rows, both grammar backends, a terminated grammar and an unconstrained row; the check must
leave every matcher where it was. Also: when checking is chosen, and the engine end to end."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve import SamplingParams, StructuredOutputsParams
from pagedserve.engine.grammar import Grammars
from pagedserve.engine.grammar_step import (CHECK_FIRST_SECONDS, EXPLORE_CHECK_EVERY, EXPLORE_FILL_EVERY, FILL_WINDOW,
                                             CheckFirstPolicy)
from pagedserve.sample.sampler import Sampler, SamplingRow

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
TEXT = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines"]}'
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def grammars(default_model_path):
    """Grammars that always check first (threshold 0), and the model's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_path))
    return Grammars(default_model_path, len(tokenizer), [tokenizer.eos_token_id], max_rows=64,
                    check_first_seconds=0.0), tokenizer


def _matchers(grammars: Grammars, tokenizer, num_rows: int) -> tuple[list, list[list[int]]]:
    """(row, matcher) pairs at different points of TEXT (xgrammar for even rows, llguidance for odd rows);
    row 5 unconstrained, row 6 terminated; each row's valid continuation."""
    from pagedserve.engine.grammar_backends import LLGuidanceBackend, XgrammarBackend

    spec = StructuredOutputsParams(json=SCHEMA)
    xgr_grammar = XgrammarBackend(tokenizer, grammars.vocab_size, [tokenizer.eos_token_id]).compile(spec)
    try:
        llg_grammar = LLGuidanceBackend(tokenizer, grammars.vocab_size, [tokenizer.eos_token_id]).compile(spec)
    except ValueError:  # llguidance misreads it (a decoder as transformers 5.17 converts GGUF files): xgrammar only
        llg_grammar = xgr_grammar
    ids = tokenizer.encode(TEXT) + [tokenizer.eos_token_id]
    pairs, nexts = [], []
    for row in range(num_rows):
        if row == 5:
            continue
        matcher = (xgr_grammar if row % 2 == 0 else llg_grammar).new_matcher()
        depth = len(ids) if row == 6 else (row * 3) % (len(ids) - 1)
        for token in ids[:depth]:
            assert matcher.accept_token(token)
        pairs.append((row, matcher))
        nexts.append(ids[depth:])
    assert dict(pairs)[6].is_terminated()
    return pairs, nexts


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(4))
def test_checked_draws_equal_the_masked_draws(grammars, seed, device):
    grammars, tokenizer = grammars
    num_rows = 24
    pairs, nexts = _matchers(grammars, tokenizer, num_rows)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, grammars.vocab_size + 64, generator=gen) * 3
    for (row, _), nxt in zip(pairs, nexts):  # half the rows favour their valid next token: accepted draws
        if nxt and row % 4 < 2:
            logits[row, nxt[0]] += 40.0
    logits = logits.to(device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    rows = [SamplingRow(SamplingParams(temperature=0.0 if r % 3 == 0 else 0.9), 1, [1], []) for r in range(num_rows)]
    eos = [tokenizer.eos_token_id]

    full_mask = grammars.step(pairs).mask()
    expected = Sampler(device, grammars.vocab_size, eos, seed=seed).launch(logits, rows, full_mask).result().token_ids
    stats = grammars.stats
    before = (stats.rows_checked, stats.rows_refused, stats.rows_filled)
    step = grammars.step(pairs)
    assert step.check_first
    checked = Sampler(device, grammars.vocab_size, eos, seed=seed).launch(logits, rows, step).result().token_ids

    assert checked == expected
    refused = stats.rows_refused - before[1]
    assert stats.rows_checked - before[0] == len(pairs)
    assert 0 < refused < len(pairs) - 1, "the logits should give both accepted and refused draws"
    assert stats.rows_filled - before[2] == refused  # masks only for the refused rows
    for (row, matcher), nxt in zip(pairs, nexts):  # no matcher moved: each still takes its own continuation
        if not matcher.is_terminated():
            assert matcher.accept_token(nxt[0]), f"row {row}'s matcher moved"


def test_refused_rows_draw_under_their_masks(grammars):
    """Every constrained row's first draw refused (the logits favour a token no JSON value starts with):
    each draws again under its mask, and the grammar takes what it draws."""
    grammars, tokenizer = grammars
    spec = StructuredOutputsParams(json=SCHEMA)
    pairs = [(row, grammars.compile(spec).new_matcher()) for row in range(8)]
    bad = tokenizer.encode("Sure")[0]
    logits = torch.zeros(8, grammars.vocab_size)
    logits[:, bad] = 50.0
    rows = [SamplingRow(SamplingParams(temperature=0.0 if r < 4 else 1.0), 1, [1], []) for r in range(8)]
    refused_before = grammars.stats.rows_refused
    out = Sampler("cpu", grammars.vocab_size, [tokenizer.eos_token_id], seed=1).launch(
        logits, rows, grammars.step(pairs)).result().token_ids
    assert grammars.stats.rows_refused - refused_before == 8
    for (_, matcher), token in zip(pairs, out):
        assert token != bad and matcher.accept_token(token)


def _decisions(policy: CheckFirstPolicy, rows: int, steps: int) -> list[bool]:
    return [policy.decide(rows) for _ in range(steps)]


def test_policy_checks_where_masks_are_dear_or_draws_rarely_refused():
    policy = CheckFirstPolicy()
    assert not any(_decisions(policy, 64, EXPLORE_CHECK_EVERY - 1))  # nothing measured yet: fill
    assert policy.decide(64)  # ... but one step in EXPLORE_CHECK_EVERY checks
    policy.note_fill(64, 1.1e-3)  # plain JSON on an H200 host: cheap enough to fill
    for _ in range(8):
        policy.note_check(True)  # and checked steps keep refusing a row
    assert not policy.prefers_check(64)
    policy.note_fill(64, 10e-3)  # one slow step (the thread's fill across a slow GIL hand-over) ...
    assert not policy.prefers_check(64)  # ... is not what masks cost
    for _ in range(FILL_WINDOW - 1):
        policy.note_fill(64, 10e-3)  # strings with maxLength: dear, step after step
    assert policy.prefers_check(64) and not policy.prefers_check(8)
    steps = _decisions(policy, 64, EXPLORE_FILL_EVERY)
    assert steps.count(False) == 1  # one step in EXPLORE_FILL_EVERY fills every mask to re-measure
    policy.note_fill(64, 0.5e-3)  # tool calls: cheap masks (one cheap fill is enough) ...
    assert not policy.dear(64)
    for _ in range(8):
        policy.note_check(False)  # ... and no draw refused
    assert policy.prefers_check(64)
    assert CheckFirstPolicy(0.0).decide(1) and all(_decisions(CheckFirstPolicy(0.0), 64, 100))
    assert CHECK_FIRST_SECONDS > 1.1e-3


def test_sampler_fills_every_mask_where_checking_does_not_pay(default_model_path, grammars):
    """A MaskSource whose check_first is False: one masked pass, no tokens checked."""
    _, tokenizer = grammars
    filling = Grammars(default_model_path, len(tokenizer), [tokenizer.eos_token_id], max_rows=8)
    spec = StructuredOutputsParams(json=SCHEMA)
    pairs = [(row, filling.compile(spec).new_matcher()) for row in range(4)]
    step = filling.step(pairs)
    assert not step.check_first
    rows = [SamplingRow(SamplingParams(temperature=0.8), 1, [1], []) for _ in range(4)]
    out = Sampler("cpu", filling.vocab_size, [tokenizer.eos_token_id], seed=0).launch(
        torch.randn(4, filling.vocab_size), rows, step).result().token_ids
    assert filling.stats.rows_checked == 0 and filling.stats.rows_filled == 4
    for (_, matcher), token in zip(pairs, out):
        assert matcher.accept_token(token)


def test_engine_checks_draws_and_masks_only_refused_rows(default_model_path):
    """Through the engine (JSON sampled from the default model at temperature 0.7, checking forced): every
    token is checked, some draws are refused (SmolLM2-135M refuses ~10-20 % of its JSON draws), only
    those rows get masks, and the outputs are JSON of the schema."""
    import jsonschema

    from pagedserve import LLM

    llm = LLM(str(default_model_path), device="cpu", seed=0, max_model_len=512)
    llm.llm_engine.grammars.policy.threshold = 0.0  # check every step
    params = SamplingParams(max_tokens=64, temperature=0.7,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    outs = llm.generate(["Describe a person as JSON:\n"] * 3, params, use_tqdm=False)
    stats = llm.llm_engine.grammars.stats
    drawn = sum(len(o.outputs[0].token_ids) for o in outs)
    assert stats.rows_checked >= drawn - len(outs)  # a sample's last token may come after its grammar ended
    assert 0 < stats.rows_refused < stats.rows_checked / 2
    assert stats.rows_filled == stats.rows_refused
    finished = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert finished
    for out in finished:
        jsonschema.validate(json.loads(out.text), SCHEMA)
