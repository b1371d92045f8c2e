"""The one check a request passes before the engine queues it.

`validate_request` is called by LLMEngine.add_request, and before that by the
CLI (before the model loads) and the server (to answer 400 without touching
the engine loop). Sampling parameters check their own ranges when they are
built (SamplingParams); this adds what needs the engine's limits. The C++
scheduler repeats the checks it relies on, as a contract guard, not as the
place users learn about their mistakes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from pagedserve.errors import RequestError
from pagedserve.sampling_params import SamplingParams

# Token ids, counts and lengths cross into C++ as int32.
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class EngineLimits:
    """What a loaded engine accepts (None: not known yet, e.g. before the model loads)."""

    max_model_len: Optional[int] = None
    max_num_seqs: Optional[int] = None
    max_logprobs: Optional[int] = None
    vocab_size: Optional[int] = None


def check_text(text: str, field: str = "prompt") -> str:
    """Text the tokenizer can take: a str holding no lone UTF-16 surrogate (e.g. a JavaScript
    string cut inside an emoji), which no UTF-8 tokenizer can encode."""
    if not isinstance(text, str):
        raise RequestError(f"{field} must be a string, got {type(text).__name__}", field, "invalid_type")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RequestError(f"{field} holds an unpaired UTF-16 surrogate at character {err.start} "
                           f"({text[err.start]!r}); send valid Unicode text", field, "invalid_text") from None
    return text


def check_token_ids(token_ids: Sequence[int], vocab_size: Optional[int], field: str = "prompt") -> list[int]:
    """The ids as plain ints, each in [0, vocab_size) (in int32 when the vocabulary is not known)."""
    ids = []
    upper = vocab_size if vocab_size is not None else INT32_MAX + 1
    for t in token_ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise RequestError(f"{field} token ids must be integers, got {t!r}", field, "invalid_type")
        if not 0 <= t < upper:
            what = f"the vocabulary [0, {vocab_size})" if vocab_size is not None else "int32"
            raise RequestError(f"{field} token id {t} is outside {what}", field, "invalid_token_id")
        ids.append(int(t))
    return ids


def validate_request(prompt_token_ids: Sequence[int], params: SamplingParams, limits: EngineLimits) -> list[int]:
    """Checks a request against the engine's limits; returns the prompt ids as a list of ints.
    Raises RequestError naming the field at fault."""
    if len(prompt_token_ids) == 0:
        raise RequestError("the prompt is empty", "prompt", "empty_prompt")
    ids = check_token_ids(prompt_token_ids, limits.vocab_size)
    check_token_ids(params.stop_token_ids or [], limits.vocab_size, "stop_token_ids")
    check_token_ids(list(params.logit_bias or ()), limits.vocab_size, "logit_bias")
    check_token_ids(params.allowed_token_ids or [], limits.vocab_size, "allowed_token_ids")
    _check_length(len(ids), params, limits.max_model_len)
    if limits.max_num_seqs is not None and params.n > limits.max_num_seqs:
        raise RequestError(f"n={params.n} is more than max_num_seqs ({limits.max_num_seqs})", "n", "too_many")
    if limits.max_logprobs is not None and params.logprobs is not None and params.logprobs > limits.max_logprobs:
        raise RequestError(f"logprobs={params.logprobs} is more than max_logprobs ({limits.max_logprobs})",
                           "logprobs", "too_many")
    if limits.max_logprobs is not None and (params.prompt_logprobs or 0) > limits.max_logprobs:
        raise RequestError(f"prompt_logprobs={params.prompt_logprobs} is more than max_logprobs "
                           f"({limits.max_logprobs})", "prompt_logprobs", "too_many")
    return ids


def _check_length(num_prompt: int, params: SamplingParams, max_model_len: Optional[int]) -> None:
    limit = max_model_len if max_model_len is not None else INT32_MAX
    if num_prompt >= limit:
        raise RequestError(f"the prompt is {num_prompt} tokens, which leaves no room to generate within "
                           f"max_model_len ({limit})", "prompt", "context_length_exceeded")
    total = num_prompt + (params.max_tokens or 1)
    if total > limit:
        raise RequestError(f"the prompt ({num_prompt} tokens) plus max_tokens ({params.max_tokens}) is {total} "
                           f"tokens, more than max_model_len ({limit})", "max_tokens", "context_length_exceeded")
    if params.min_tokens > limit - num_prompt:
        raise RequestError(f"min_tokens={params.min_tokens} is more than the {limit - num_prompt} tokens the "
                           f"context leaves after the prompt", "min_tokens", "context_length_exceeded")
