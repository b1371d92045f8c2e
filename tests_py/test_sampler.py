"""The batched sampler against naive per-row Python references."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from pagedserve.sample import sampling_ops
from pagedserve.sample.sampler import Sampler, SampleLogprobs, SamplingRow
from pagedserve.sample.sampling_ops import apply_min_p_, apply_penalties, apply_top_k_top_p_
from pagedserve.sampling_params import SamplingParams
from pagedserve.sample.sampling_tensors import build_sampling_batch
from ops_testing import DEVICES

EOS = 3
NEG_INF = float("-inf")



# -- naive references (per row, plain Python) ----------------------------------------


def naive_penalized(logits: list[float], params: SamplingParams, prompt: list[int],
                    output: list[int], eos_ids: list[int]) -> list[float]:
    row = list(logits)
    if len(output) < params.min_tokens:
        blocked = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        for t in blocked:
            row[t] = NEG_INF
    for t in set(prompt) | set(output):
        rep = params.repetition_penalty
        row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
    for t, count in Counter(output).items():
        row[t] -= params.frequency_penalty * count + params.presence_penalty
    return row


def naive_softmax(row: list[float]) -> list[float]:
    top = max(row)
    exps = [math.exp(x - top) if x != NEG_INF else 0.0 for x in row]
    total = sum(exps)
    return [e / total for e in exps]


def naive_truncated_distribution(row: list[float], params: SamplingParams) -> list[float]:
    """temperature -> min_p -> top_k -> top_p, the final sampling distribution."""
    row = [x / params.temperature for x in row]
    probs = naive_softmax(row)
    threshold = params.min_p * max(probs)
    row = [x if p >= threshold else NEG_INF for x, p in zip(row, probs)]
    order = sorted(range(len(row)), key=lambda t: -row[t])
    if params.top_k > 0:
        for t in order[params.top_k:]:
            row[t] = NEG_INF
    probs = naive_softmax(row)
    mass = 0.0
    for t in order:
        if mass >= params.top_p:
            row[t] = NEG_INF
        mass += probs[t]
    return naive_softmax(row)


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale


def row(params: SamplingParams, prompt=(), output=(), num_samples=1, generator=None):
    return SamplingRow(params, num_samples, list(prompt), list(output), generator)


# -- greedy ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_batch_is_argmax(device):
    logits = random_logits(6, 50, seed=1).to(device)
    sampler = Sampler(device, 50, [EOS], seed=0)
    rows = [row(SamplingParams(temperature=0.0)) for _ in range(6)]
    rows[2] = row(SamplingParams(temperature=0.0), num_samples=3)
    out = sampler(logits, rows)
    expected = logits.argmax(dim=-1).tolist()
    assert out.token_ids == expected[:2] + [expected[2]] * 3 + expected[3:]
    assert out.logprobs is None


def test_greedy_rows_in_a_mixed_batch_take_the_penalized_argmax():
    vocab = 40
    logits = random_logits(4, vocab, seed=2)
    sampler = Sampler("cpu", vocab, [EOS], seed=0)
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.7, frequency_penalty=0.9)
    prompt, output = [5, 9, 9, 12], [int(t) for t in logits[0].topk(3).indices] * 2
    rows = [row(greedy, prompt, output), row(SamplingParams(temperature=0.7)),
            row(SamplingParams(temperature=1e-6)), row(SamplingParams(top_k=3))]
    out = sampler(logits, rows)
    penalized = naive_penalized(logits[0].tolist(), greedy, prompt, output, [EOS])
    assert out.token_ids[0] == max(range(vocab), key=lambda t: penalized[t])
    assert out.token_ids[0] != int(logits[0].argmax())  # the penalty changed the answer
    assert out.token_ids[2] == int(logits[2].argmax())


def test_padded_vocab_columns_are_never_sampled():
    logits = random_logits(3, 64, seed=3)
    logits[:, 48:] = 100.0  # padding columns beyond the real vocabulary
    sampler = Sampler("cpu", 48, [EOS], seed=0)
    out = sampler(logits, [row(SamplingParams(temperature=0.0)), row(SamplingParams()),
                           row(SamplingParams(top_p=0.5, logprobs=2))])
    assert all(0 <= t < 48 for t in out.token_ids)
    assert out.token_ids[0] == int(logits[0, :48].argmax())


def test_callers_logits_are_not_modified():
    logits = random_logits(3, 30, seed=4)
    before = logits.clone()
    sampler = Sampler("cpu", 30, [EOS], seed=0)
    params = SamplingParams(temperature=0.5, top_k=4, top_p=0.8, min_p=0.1,
                            repetition_penalty=1.3, presence_penalty=0.5, min_tokens=2)
    sampler(logits, [row(params, [1, 2], [7]), row(SamplingParams(temperature=0.0)),
                     row(SamplingParams(logprobs=3))])
    assert torch.equal(logits, before)


# -- truncation masks vs naive -----------------------------------------------------


MIXED_TRUNCATION = [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.3), (0, 0.9), (6, 0.5), (37, 0.99),
                    (0, 1.0)]
TOP_K_ONLY = [(0, 1.0), (1, 1.0), (5, 1.0), (36, 1.0), (37, 1.0), (2, 1.0), (0, 1.0), (0, 1.0)]


@pytest.mark.parametrize("settings, limit", [
    (MIXED_TRUNCATION, None),  # one sort for top_k and top_p
    (TOP_K_ONLY, None),  # top_k alone: partial selection
    (TOP_K_ONLY, 4),  # top_k above the selection limit: the sort path without top_p
], ids=["sort", "select", "sort_top_k_only"])
def test_top_k_top_p_masks_match_naive_per_row(settings, limit, monkeypatch):
    vocab = 37
    if limit is not None:
        monkeypatch.setattr(sampling_ops, "TOP_K_SELECT_LIMIT", limit)
    logits = random_logits(8, vocab, seed=5)
    logits[7, :20] -= 40.0  # tiny-probability tail: a row without top_p must keep it
    params = [SamplingParams(top_k=k, top_p=p) for k, p in settings]
    batch = build_sampling_batch([row(p) for p in params], vocab, [EOS], torch.device("cpu"))
    masked = logits.clone()
    apply_top_k_top_p_(masked, batch.top_k, batch.top_p, batch.max_top_k)
    for i, p in enumerate(params):
        expected = naive_truncated_distribution(logits[i].tolist(), p)
        kept = {t for t in range(vocab) if masked[i, t] != NEG_INF}
        assert kept == {t for t in range(vocab) if expected[t] > 0}, f"row {i} ({settings[i]})"
        assert torch.equal(masked[i][masked[i] != NEG_INF], logits[i][masked[i] != NEG_INF])
    assert (masked[7] != NEG_INF).all()


def test_min_p_mask_matches_naive_per_row():
    vocab = 41
    logits = random_logits(5, vocab, seed=6)
    min_ps = [0.0, 0.02, 0.1, 0.5, 1.0]
    masked = logits.clone()
    apply_min_p_(masked, torch.tensor(min_ps).unsqueeze(1))
    for i, min_p in enumerate(min_ps):
        probs = naive_softmax(logits[i].tolist())
        expected = {t for t in range(vocab) if probs[t] >= min_p * max(probs)}
        assert {t for t in range(vocab) if masked[i, t] != NEG_INF} == expected, f"min_p={min_p}"


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_frequencies_match_the_naive_distribution(device):
    """Many draws per row against the naive final distribution (fixed seed: cannot flake)."""
    vocab, draws = 24, 20000
    logits = random_logits(4, vocab, seed=7, scale=1.5)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_k=8),
              SamplingParams(temperature=1.4, top_p=0.7, min_p=0.05),
              SamplingParams(temperature=0.9, top_k=10, top_p=0.85, min_p=0.02)]
    sampler = Sampler(device, vocab, [EOS], seed=123)
    out = sampler(logits.to(device), [row(p, num_samples=draws) for p in params])
    for i, p in enumerate(params):
        expected = naive_truncated_distribution(logits[i].tolist(), p)
        counts = Counter(out.token_ids[i * draws:(i + 1) * draws])
        for t in range(vocab):
            freq = counts[t] / draws
            if expected[t] == 0.0:
                assert counts[t] == 0, f"row {i}: masked token {t} was sampled"
            else:
                sigma = math.sqrt(expected[t] * (1 - expected[t]) / draws)
                assert abs(freq - expected[t]) < 5 * sigma + 1e-3, f"row {i} token {t}"


# -- penalties and min_tokens ------------------------------------------------------


def test_penalties_match_naive():
    vocab = 30
    logits = random_logits(5, vocab, seed=8)
    gen = torch.Generator().manual_seed(9)
    histories = [(torch.randint(0, vocab, (n,), generator=gen).tolist(),
                  torch.randint(0, vocab, (m,), generator=gen).tolist())
                 for n, m in [(7, 12), (3, 0), (0, 9), (15, 4), (5, 5)]]
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=-0.7),
              SamplingParams(repetition_penalty=0.6),
              SamplingParams(frequency_penalty=-1.1),
              SamplingParams(),
              SamplingParams(presence_penalty=1.9)]
    rows = [row(p, prompt, output) for p, (prompt, output) in zip(params, histories)]
    batch = build_sampling_batch(rows, vocab, [EOS], torch.device("cpu"))
    got = apply_penalties(logits, batch.penalties)
    for i, (p, (prompt, output)) in enumerate(zip(params, histories)):
        expected = torch.tensor(naive_penalized(logits[i].tolist(), p, prompt, output, [EOS]))
        torch.testing.assert_close(got[i], expected, msg=f"row {i}")
    assert not torch.equal(got[0], logits[0])


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    vocab = 20
    logits = random_logits(4, vocab, seed=10)
    logits[:, EOS] = 50.0
    logits[:, 7] = 40.0
    sampler = Sampler("cpu", vocab, [EOS], seed=0)
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7])
    ignore_eos = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7], ignore_eos=True)
    out = sampler(logits, [row(params, output=[1, 2]), row(params, output=[1, 2, 4]),
                           row(ignore_eos, output=[1]), row(SamplingParams(temperature=0.0))])
    masked_row0 = logits[0].clone()
    masked_row0[[EOS, 7]] = NEG_INF
    assert out.token_ids[0] == int(masked_row0.argmax())
    assert out.token_ids[1] == EOS  # min_tokens reached: EOS allowed again
    assert out.token_ids[2] == EOS  # ignore_eos: EOS is not masked, the stop token is
    assert out.token_ids[3] == EOS


def test_min_tokens_with_ignore_eos_and_no_stop_ids_masks_nothing():
    """The one-pass sampling path takes such rows (nothing to mask): EOS stays an ordinary token."""
    vocab = 20
    logits = random_logits(2, vocab, seed=12)
    logits[:, EOS] = 50.0
    sampler = Sampler("cpu", vocab, [EOS], seed=0)
    params = SamplingParams(temperature=0.0, min_tokens=5, ignore_eos=True)
    out = sampler(logits, [row(params, output=[1]), row(SamplingParams(temperature=0.0, min_tokens=5), output=[1])])
    assert out.token_ids[0] == EOS
    masked = logits[1].clone()
    masked[EOS] = NEG_INF
    assert out.token_ids[1] == int(masked.argmax())


def test_min_tokens_applies_to_random_rows():
    vocab = 16
    logits = random_logits(1, vocab, seed=11)
    logits[0, EOS] = 30.0
    sampler = Sampler("cpu", vocab, [EOS], seed=1)
    out = sampler(logits, [row(SamplingParams(min_tokens=5), output=[1], num_samples=200)])
    assert EOS not in out.token_ids


# -- seeds and parallel sampling ---------------------------------------------------


def test_seeded_row_is_reproducible_across_batch_composition_and_order():
    vocab, steps = 500, 4
    target_logits = [random_logits(1, vocab, seed=100 + s, scale=0.5) for s in range(steps)]
    params = SamplingParams(seed=42, temperature=1.0, top_p=0.95)

    def tokens_in(position: int, others: int, sampler_seed: int) -> list[int]:
        sampler = Sampler("cpu", vocab, [EOS], seed=sampler_seed)
        generator = sampler.generator_for(params)
        result = []
        for s in range(steps):
            other_logits = random_logits(others, vocab, seed=1000 * sampler_seed + s)
            logits = torch.cat([other_logits[:position], target_logits[s], other_logits[position:]])
            rows = [row(SamplingParams(temperature=0.8)) for _ in range(others)]
            rows.insert(position, row(params, output=[1] * s, generator=generator))
            result.append(sampler(logits, rows).token_ids[position])
        return result

    alone = tokens_in(0, 0, sampler_seed=1)
    assert tokens_in(2, 5, sampler_seed=2) == alone
    assert tokens_in(5, 5, sampler_seed=3) == alone
    other_seed = SamplingParams(seed=43, temperature=1.0, top_p=0.95)
    sampler = Sampler("cpu", vocab, [EOS], seed=1)
    generator = sampler.generator_for(other_seed)
    different = [sampler(target_logits[s], [row(other_seed, generator=generator)]).token_ids[0]
                 for s in range(steps)]
    assert different != alone


def test_unseeded_rows_follow_the_sampler_seed():
    vocab = 300
    logits = random_logits(3, vocab, seed=12, scale=0.3)
    rows = [row(SamplingParams()) for _ in range(3)]
    first = Sampler("cpu", vocab, [EOS], seed=5)(logits, rows).token_ids
    assert Sampler("cpu", vocab, [EOS], seed=5)(logits, rows).token_ids == first
    assert Sampler("cpu", vocab, [EOS], seed=6)(logits, rows).token_ids != first


def test_parallel_samples_differ_and_are_reproducible_with_a_seed():
    vocab, n = 1000, 8
    logits = random_logits(1, vocab, seed=13, scale=0.2)
    params = SamplingParams(n=n, seed=7)

    def draw(batch_before: int) -> list[int]:
        sampler = Sampler("cpu", vocab, [EOS], seed=batch_before)
        before = [row(SamplingParams(), num_samples=2) for _ in range(batch_before)]
        all_logits = torch.cat([random_logits(batch_before, vocab, seed=99), logits])
        out = sampler(all_logits, before + [row(params, num_samples=n,
                                                generator=sampler.generator_for(params))])
        return out.token_ids[2 * batch_before:]

    samples = draw(0)
    assert len(samples) == n and len(set(samples)) > 1
    assert draw(3) == samples


def test_forked_generators_are_distinct_and_reproducible():
    sampler = Sampler("cpu", 100, [EOS])
    params = SamplingParams(seed=11)
    draws = [sampler.generator_for(params, i).initial_seed() for i in range(4)]
    assert len(set(draws)) == 4
    assert draws == [sampler.generator_for(params, i).initial_seed() for i in range(4)]
    assert draws[0] == 11
    assert sampler.generator_for(SamplingParams()) is None


# -- logprobs ----------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_come_from_the_raw_distribution(device):
    vocab = 60
    logits = random_logits(4, vocab, seed=14)
    sampler = Sampler(device, vocab, [EOS], seed=0)
    params = [SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=1.8),
              SamplingParams(temperature=0.7, top_k=3, logprobs=2),
              SamplingParams(),
              SamplingParams(temperature=1.3, logprobs=0)]
    rows = [row(params[0], prompt=[int(logits[0].argmax())]), row(params[1], num_samples=3),
            row(params[2]), row(params[3], num_samples=2)]
    out = sampler(logits.to(device), rows)
    raw = torch.log_softmax(logits.double(), dim=-1)
    sample_rows = [0, 1, 1, 1, 2, 3, 3]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 7
    for i, r in enumerate(sample_rows):
        entry = out.logprobs[i]
        if params[r].logprobs is None:
            assert entry is None
            continue
        assert isinstance(entry, SampleLogprobs)
        token = out.token_ids[i]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(raw[r, token]), abs=1e-5)
        assert entry.rank == 1 + int((raw[r] > raw[r, token]).sum())
        top = sorted(range(vocab), key=lambda t: -float(raw[r, t]))[:params[r].logprobs]
        assert [t for t, _ in entry.top] == top
        for t, lp in entry.top:
            assert lp == pytest.approx(float(raw[r, t]), abs=1e-5)
    assert out.logprobs[0].rank > 1  # the penalty moved greedy off the raw argmax


# -- input checks ------------------------------------------------------------------


def test_bad_inputs_are_rejected_with_clear_errors():
    sampler = Sampler("cpu", 10, [EOS])
    logits = random_logits(2, 10, seed=15)
    with pytest.raises(ValueError, match="rows"):
        sampler(logits, [row(SamplingParams())])
    with pytest.raises(ValueError, match="vocab_size"):
        sampler(logits[:, :8], [row(SamplingParams()), row(SamplingParams())])
    with pytest.raises(ValueError, match="num_samples"):
        sampler(logits, [row(SamplingParams()), row(SamplingParams(), num_samples=0)])
    with pytest.raises(ValueError, match="penalties"):
        sampler(logits, [row(SamplingParams(repetition_penalty=1.2), prompt=[11]),
                         row(SamplingParams())])
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler("cpu", 0, [EOS])
    assert sampler(logits[:0], []).token_ids == []
