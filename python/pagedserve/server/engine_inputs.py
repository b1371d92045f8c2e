"""From API request bodies to engine inputs: token-id prompts and SamplingParams.

The rules are the engine's own, not copies: SamplingParams checks its
ranges, pagedserve.engine.validation checks text, token ids and the engine's
limits. The server runs them before submitting, so a refusal is a 400 without
a trip through the engine loop; their RequestError becomes the 400 body
naming the field (errors.py). What is left here is the API's side: the body
fields the server does not support, and how prompts and messages become
token ids.
"""

from __future__ import annotations

from typing import Optional, Union

from pagedserve.engine.validation import EngineLimits, check_text, validate_request
from pagedserve.errors import RequestError
from pagedserve.server.errors import bad_request, from_request_error
from pagedserve.server.protocol import CompletionRequest, SamplingFields

# Body fields that, when left out, take the model's default (EngineInfo.default_sampling: the model's
# generation_config.json over pagedserve's defaults), as vLLM does; the rest take the OpenAI defaults.
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def require_tokenizer(tokenizer, what: str) -> None:
    if tokenizer is None:
        raise bad_request(f"this model has no tokenizer, so {what} cannot be used: send prompts as token ids")


def completion_prompts(body: CompletionRequest, tokenizer) -> list[dict]:
    """The prompts of a completions body (a string, strings, token ids or lists of them) as
    engine prompt dicts {"prompt": text | None, "prompt_token_ids": [...]}, in order."""
    from pagedserve.engine.tokenizer import encode_prompt

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
            checked_text(item, where, "prompt")
            prompts.append({"prompt": item, "prompt_token_ids": encode_prompt(tokenizer, item)})
        else:
            if not item:
                raise bad_request(f"'{where}' is an empty list of token ids", "prompt")
            prompts.append({"prompt": None, "prompt_token_ids": list(item)})
    return prompts


def checked_text(text: str, where: str, param: str) -> str:
    """`text` if the engine takes it (engine.validation.check_text), else a 400 naming `param`."""
    try:
        return check_text(text, where)
    except RequestError as err:
        raise from_request_error(err, param) from None


def check_prompts(prompts: list[dict], params, limits: EngineLimits, prompt_param: str = "prompt") -> None:
    """The engine's own check of each prompt with these params (ids, lengths, n, logprobs); the
    prompt's field is reported as `prompt_param` (the chat API's is "messages")."""
    for p in prompts:
        try:
            p["prompt_token_ids"] = validate_request(p["prompt_token_ids"], params, limits)
        except RequestError as err:
            raise from_request_error(err, prompt_param if err.field == "prompt" else None) from None


def sampling_params(body: SamplingFields, max_tokens: Optional[int], logprobs: Optional[int], defaults: dict,
                    structured):
    """SamplingParams for a body: fields it leaves out take `defaults` (the model's) where
    MODEL_DEFAULT_FIELDS says so; `structured` is the request's StructuredOutputsParams or None (the
    body's own, structured_outputs(body), or what a chat request's tool_choice needs). Raises
    RequestError naming the field out of range."""
    from pagedserve.sampling_params import SamplingParams

    for i, s in enumerate([body.stop] if isinstance(body.stop, str) else body.stop or []):
        checked_text(s, "stop" if isinstance(body.stop, str) else f"stop[{i}]", "stop")
    for i, word in enumerate(body.bad_words or []):
        checked_text(word, f"bad_words[{i}]", "bad_words")
    shaping = {name: getattr(body, name) for name in MODEL_DEFAULT_FIELDS}
    for name, value in list(shaping.items()):
        if value is None:
            if name in defaults:
                shaping[name] = defaults[name]
            else:
                del shaping[name]  # SamplingParams' own default
    return SamplingParams(
        n=body.n, max_tokens=max_tokens, logprobs=logprobs, **shaping,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids,
        include_stop_str_in_output=body.include_stop_str_in_output, ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens, skip_special_tokens=body.skip_special_tokens,
        logit_bias=body.logit_bias or None, allowed_token_ids=body.allowed_token_ids, bad_words=body.bad_words,
        structured_outputs=structured)


_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag",
                    "disable_any_whitespace")


def structured_outputs(body: SamplingFields):
    """The StructuredOutputsParams a body asks for (response_format, structured_outputs or a guided_*
    field; at most one of them), or None. The engine compiles it when the request is added."""
    from pagedserve.sampling_params import StructuredOutputsParams

    found: dict[str, dict] = {}
    rf = body.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found["response_format"] = {"json_object": True}
        elif rf.type == "json_schema":
            js = rf.json_schema
            if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                raise bad_request("response_format json_schema needs json_schema.schema (a JSON schema object)",
                                  "response_format")
            found["response_format"] = {"json": js["schema"]}
        else:
            raise bad_request(f"response_format {rf.type!r} is not supported (text, json_object, json_schema)",
                              "response_format")
    if body.structured_outputs is not None:
        unknown = sorted(set(body.structured_outputs) - set(_STRUCTURED_KEYS))
        if unknown:
            raise bad_request(f"structured_outputs: unsupported key(s) {', '.join(unknown)}", "structured_outputs")
        found["structured_outputs"] = dict(body.structured_outputs)
    for name, kind in _GUIDED_FIELDS.items():
        if getattr(body, name) is not None:
            found[name] = {kind: getattr(body, name)}
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"send one of {', '.join(found)}, not several", next(iter(found)))
    (field, spec), = found.items()
    try:
        return StructuredOutputsParams(**spec)
    except RequestError as err:
        raise from_request_error(err, field) from None


def check_completion_options(body: CompletionRequest) -> None:
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request(f"best_of={body.best_of} different from n={body.n} is not supported", "best_of")
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("max_tokens=0 needs echo=true (it scores the prompt without generating)", "max_tokens")
