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
from pagedserve.server.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields,
                                        TokenizeRequest)

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
            _check_text(item, where, "prompt")
            prompts.append({"prompt": item, "prompt_token_ids": encode_prompt(tokenizer, item)})
        else:
            if not item:
                raise bad_request(f"'{where}' is an empty list of token ids", "prompt")
            prompts.append({"prompt": None, "prompt_token_ids": list(item)})
    return prompts


def chat_prompt(body: Union[ChatCompletionRequest, TokenizeRequest], tokenizer,
                chat_template: Optional[str] = None) -> dict:
    """The conversation rendered with the model's chat template (or the server's --chat-template),
    as an engine prompt dict."""
    if not body.messages:
        raise bad_request("'messages' is empty: send at least one message", "messages")
    require_tokenizer(tokenizer, "chat messages")
    from pagedserve.engine.tokenizer import CHAT_TEMPLATE_RESERVED_KWARGS

    for key in body.chat_template_kwargs or {}:
        if key in CHAT_TEMPLATE_RESERVED_KWARGS:
            raise bad_request(f"chat_template_kwargs may not set {key!r}", "chat_template_kwargs")
    if body.continue_final_message:
        if body.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs the last message to be the assistant's",
                              "continue_final_message")
        if body.add_generation_prompt and "add_generation_prompt" in body.model_fields_set:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                              "continue_final_message")
    # continue_final_message leaves the last message open, so the generation prompt is off (as vLLM needs).
    add_generation_prompt = body.add_generation_prompt and not body.continue_final_message
    ids = render_chat(tokenizer, body.messages, add_generation_prompt, chat_template,
                      body.continue_final_message, body.chat_template_kwargs)
    return {"prompt": None, "prompt_token_ids": ids}


def render_chat(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool,
                chat_template: Optional[str] = None, continue_final_message: bool = False,
                chat_template_kwargs: Optional[dict] = None) -> list[int]:
    from pagedserve.engine.tokenizer import apply_chat_template

    dicts = [message_dict(m, i) for i, m in enumerate(messages)]
    try:
        return apply_chat_template(tokenizer, dicts, add_generation_prompt=add_generation_prompt,
                                   chat_template=chat_template, continue_final_message=continue_final_message,
                                   chat_template_kwargs=chat_template_kwargs)
    except ValueError as err:
        raise bad_request(str(err), "messages") from err
    except Exception as err:  # a template may raise anything (jinja2 errors) on a conversation it rejects
        raise bad_request(f"the model's chat template rejected the messages: {err}",
                          "messages") from err


def message_dict(message: ChatMessage, position: int) -> dict:
    """A chat message as the template expects it; text parts are joined, other parts refused."""
    content = message.content
    where = f"messages[{position}]"
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content: only text parts are supported, got a part "
                                  f"of type {part.get('type')!r}", "messages")
            texts.append(part["text"])
        content = "\n".join(texts)
    out = {"role": message.role, "content": _check_text(content or "", f"{where}.content", "messages")}
    if message.name:
        out["name"] = _check_text(message.name, f"{where}.name", "messages")
    return out


def _check_text(text: str, where: str, param: str) -> str:
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


def sampling_params(body: SamplingFields, max_tokens: Optional[int], logprobs: Optional[int], defaults: dict):
    """SamplingParams for a body: fields it leaves out take `defaults` (the model's) where
    MODEL_DEFAULT_FIELDS says so. Raises RequestError naming the field out of range."""
    from pagedserve.sampling_params import SamplingParams

    for i, s in enumerate([body.stop] if isinstance(body.stop, str) else body.stop or []):
        _check_text(s, "stop" if isinstance(body.stop, str) else f"stop[{i}]", "stop")
    for i, word in enumerate(body.bad_words or []):
        _check_text(word, f"bad_words[{i}]", "bad_words")
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
        structured_outputs=structured_outputs(body))


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
    if body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs would need prompt logprobs, which are not computed", "echo")


def check_chat_options(body: ChatCompletionRequest) -> None:
    if body.tools:
        raise bad_request("tools are not supported", "tools")
    if body.tool_choice is not None and body.tool_choice != "none":
        raise bad_request("tool_choice is not supported (tools are not)", "tool_choice")
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")


def chat_logprobs(body: ChatCompletionRequest) -> Optional[int]:
    return (body.top_logprobs or 0) if body.logprobs else None
