"""SamplingParams: vLLM's defaults, normalization and range checks."""

from __future__ import annotations

import pytest

from pagedserve.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.seed, p.stop, p.stop_token_ids) == (None, [], [])
    assert not p.include_stop_str_in_output and not p.ignore_eos and p.skip_special_tokens
    assert (p.max_tokens, p.min_tokens, p.logprobs) == (16, 0, None)
    assert not p.greedy and not p.has_penalties and not p.top_k_enabled


def test_normalization():
    p = SamplingParams(stop="###", stop_token_ids=(5, 6), top_k=-1, seed=-1)
    assert p.stop == ["###"] and p.stop_token_ids == [5, 6]
    assert p.top_k == 0 and not p.top_k_enabled
    assert p.seed is None
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(max_tokens=None).max_tokens is None


@pytest.mark.parametrize("temperature, greedy",
                         [(0.0, True), (1e-6, True), (1e-5, False), (0.7, False)])
def test_greedy_property(temperature, greedy):
    assert SamplingParams(temperature=temperature).greedy is greedy


def test_greedy_disables_truncation():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    q = SamplingParams(temperature=0.5, top_p=0.5, top_k=3, min_p=0.2)
    assert (q.top_p, q.top_k, q.min_p) == (0.5, 3, 0.2)


def test_has_penalties():
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.5).has_penalties
    assert SamplingParams(presence_penalty=0.5).has_penalties


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "n must be at least 1"),
    (dict(n=1.5), "n must be an int"),
    (dict(temperature=-0.1), "temperature must be non-negative"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.01), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-2), "top_k must be -1 or 0"),
    (dict(top_k=2.5), "top_k must be an int"),
    (dict(min_p=-0.01), r"min_p must be in \[0, 1\]"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
    (dict(presence_penalty=-2.01), r"presence_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=-3.0), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be greater than 0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be greater than 0"),
    (dict(max_tokens=0), "max_tokens must be at least 1"),
    (dict(min_tokens=-1), "min_tokens must be at least 0"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens must be at most max_tokens=10"),
    (dict(logprobs=-1), "logprobs must be at least 0"),
    (dict(seed=1.0), "seed must be an int"),
    (dict(stop=["ok", ""]), "stop must not contain an empty string"),
    (dict(stop=[3]), "stop must hold strings"),
    (dict(stop_token_ids=[-4]), "stop_token_ids must be non-negative"),
])
def test_out_of_range_values_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_boundary_values_are_accepted():
    SamplingParams(top_p=1.0, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0,
                   repetition_penalty=0.01, top_k=1, max_tokens=1, min_tokens=1, logprobs=0, n=4)
    SamplingParams(min_tokens=50, max_tokens=None)
