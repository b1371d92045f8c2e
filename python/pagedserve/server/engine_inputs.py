"""From API request bodies to engine inputs: token-id prompts and SamplingParams.

Everything a request can get wrong is caught here, before it reaches the
engine, and reported as a 400 naming the offending parameter: the engine's
own checks stay as the last line of defence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from pagedserve.server.errors import APIError, bad_request
from pagedserve.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields

# Defaults of the OpenAI API where the body leaves a field out.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0


@dataclass(frozen=True)
class EngineLimits:
    """The configured limits a request is checked against."""

    max_model_len: int
    max_num_seqs: int
    max_logprobs: int
    vocab_size: int


def require_tokenizer(tokenizer, what: str) -> None:
    if tokenizer is None:
        raise bad_request(f"this model has no tokenizer, so {what} cannot be used: send prompts as token ids")


def completion_prompts(body: CompletionRequest, tokenizer) -> list[dict]:
    """The prompts of a completions body (a string, strings, token ids or lists of them) as
    engine prompt dicts {"prompt": text | None, "prompt_token_ids": [...]}, in order."""
    from pagedserve.tokenizer import encode_prompt

    prompt = body.prompt
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        items: list[Union[str, list[int]]] = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("'prompt' is empty: send a string, a list of strings or token ids", "prompt")
    prompts = []
    for i, item in enumerate(items):
        where = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            if not item:
                raise bad_request(f"'{where}' is an empty string", "prompt")
            require_tokenizer(tokenizer, "text prompts")
            prompts.append({"prompt": item, "prompt_token_ids": encode_prompt(tokenizer, item)})
        else:
            if not item:
                raise bad_request(f"'{where}' is an empty list of token ids", "prompt")
            prompts.append({"prompt": None, "prompt_token_ids": [int(t) for t in item]})
    return prompts


def chat_prompt(body: ChatCompletionRequest, tokenizer) -> dict:
    """The conversation rendered with the model's chat template, as an engine prompt dict."""
    from pagedserve.tokenizer import apply_chat_template

    if not body.messages:
        raise bad_request("'messages' is empty: send at least one message", "messages")
    require_tokenizer(tokenizer, "chat messages")
    messages = [message_dict(m, i) for i, m in enumerate(body.messages)]
    try:
        ids = apply_chat_template(tokenizer, messages, add_generation_prompt=body.add_generation_prompt)
    except ValueError as err:
        raise bad_request(str(err), "messages") from err
    except Exception as err:  # a template may raise anything (jinja2 errors) on a conversation it rejects
        raise bad_request(f"the model's chat template rejected the messages: {err}", "messages") from err
    return {"prompt": None, "prompt_token_ids": ids}


def message_dict(message: ChatMessage, position: int) -> dict:
    """A chat message as the template expects it; text parts are joined, other parts refused."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{position}].content: only text parts are supported, got a part "
                                  f"of type {part.get('type')!r}", "messages")
            texts.append(part["text"])
        content = "\n".join(texts)
    out = {"role": message.role, "content": content or ""}
    if message.name:
        out["name"] = message.name
    return out


def check_token_ids(prompts: list[dict], limits: EngineLimits) -> None:
    for p in prompts:
        bad = [t for t in p["prompt_token_ids"] if not 0 <= t < limits.vocab_size]
        if bad:
            raise bad_request(f"prompt token id {bad[0]} is outside the vocabulary [0, {limits.vocab_size})",
                              "prompt")


def resolve_max_tokens(requested: Optional[int], prompt_lengths: list[int], limits: EngineLimits,
                       prompt_param: str) -> int:
    """max_tokens as asked, or whatever context the longest prompt leaves; 400 when they do not fit."""
    longest = max(prompt_lengths)
    room = limits.max_model_len - longest
    if room < 1:
        raise bad_request(f"the prompt is {longest} tokens, which leaves no room to generate within "
                          f"max_model_len ({limits.max_model_len})", prompt_param, code="context_length_exceeded")
    if requested is None:
        return room
    if requested > room:
        raise bad_request(f"the prompt ({longest} tokens) plus max_tokens ({requested}) is {longest + requested} "
                          f"tokens, more than max_model_len ({limits.max_model_len})", "max_tokens",
                          code="context_length_exceeded")
    return requested


def sampling_params(body: SamplingFields, max_tokens: int, logprobs: Optional[int], limits: EngineLimits):
    """SamplingParams for a body; range errors become 400s naming the parameter."""
    from pagedserve.sampling_params import SamplingParams

    if body.n > limits.max_num_seqs:
        raise bad_request(f"n={body.n} is more than this server allows (max_num_seqs {limits.max_num_seqs})", "n")
    if logprobs is not None and logprobs > limits.max_logprobs:
        raise bad_request(f"logprobs={logprobs} is more than this server allows (max_logprobs "
                          f"{limits.max_logprobs})", "logprobs")
    if body.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    try:
        return SamplingParams(
            n=body.n, max_tokens=max_tokens, logprobs=logprobs,
            temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
            top_p=DEFAULT_TOP_P if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k, min_p=0.0 if body.min_p is None else body.min_p,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids,
            include_stop_str_in_output=body.include_stop_str_in_output, ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens, skip_special_tokens=body.skip_special_tokens)
    except (ValueError, TypeError) as err:
        raise _param_error(str(err), body) from err


def _param_error(message: str, body: SamplingFields) -> APIError:
    # SamplingParams' messages start with the field's name ("top_p must be in (0, 1], got 2.0").
    first = message.split(" ", 1)[0]
    return bad_request(message, first if first in type(body).model_fields else None)


def check_completion_options(body: CompletionRequest) -> None:
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request(f"best_of={body.best_of} different from n={body.n} is not supported", "best_of")
    if body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs would need prompt logprobs, which are not computed", "echo")


def check_chat_options(body: ChatCompletionRequest) -> None:
    if body.response_format is not None and body.response_format.type != "text":
        raise bad_request(f"response_format {body.response_format.type!r} is not supported (only 'text')",
                          "response_format")
    if body.tools:
        raise bad_request("tools are not supported", "tools")
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")


def chat_logprobs(body: ChatCompletionRequest) -> Optional[int]:
    return (body.top_logprobs or 0) if body.logprobs else None
