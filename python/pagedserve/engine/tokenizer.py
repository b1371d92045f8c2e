"""Loading a HF tokenizer and turning prompts and chats into token ids."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence, Union

import numpy as np

from pagedserve.engine.validation import check_text
from pagedserve.errors import RequestError

PromptType = Union[str, list[int], dict]  # text, token ids, or {"prompt": ...} / {"prompt_token_ids": ...}

if TYPE_CHECKING:  # importing transformers takes seconds: load_tokenizer imports it when it must
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(model_dir: Union[str, Path]) -> PreTrainedTokenizerBase:
    """The tokenizer saved in a HF-format model directory; never touches the network."""
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model_dir {str(path)!r} is not a directory")
    from pagedserve.engine.fast_tokenizer import load_fast_tokenizer

    fast = load_fast_tokenizer(path)  # a plain tokenizer.json: the same tokenizer, without transformers
    if fast is not None:
        return fast
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"model_dir {str(path)!r} holds no loadable tokenizer: {err}") from err


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of a plain-text prompt, with BOS when the tokenizer is set to add one.

    A prompt that already starts with the BOS text (e.g. a chat template
    rendered by the user) does not get a second BOS.
    """
    ids = list(tokenizer.encode(text, add_special_tokens=True))
    bos_id, bos_text = tokenizer.bos_token_id, tokenizer.bos_token
    if (bos_id is not None and bos_text and text.startswith(bos_text)
            and ids[:2] == [bos_id, bos_id]):
        ids = ids[1:]
    return ids


# apply_chat_template's own arguments: chat_template_kwargs may not set them.
CHAT_TEMPLATE_RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "tokenize", "add_generation_prompt",
    "continue_final_message", "chat_template", "return_dict", "return_tensors", "padding", "truncation",
    "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"})


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]],
                        add_generation_prompt: bool = True, *, chat_template: Optional[str] = None,
                        continue_final_message: bool = False,
                        chat_template_kwargs: Optional[Mapping[str, Any]] = None,
                        tools: Optional[Sequence[Mapping[str, Any]]] = None) -> list[int]:
    """Token ids of a chat rendered with the model's template (or `chat_template`, its text).

    The template writes every special token itself (BOS included), so the
    rendered text is encoded without adding any. continue_final_message leaves
    the last (assistant) message open for the model to continue; it excludes
    add_generation_prompt. chat_template_kwargs become template variables
    (e.g. enable_thinking). tools (OpenAI function tools) are given to the template.
    """
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    if continue_final_message and (not messages or not isinstance(messages[-1], Mapping)
                                   or messages[-1].get("role") != "assistant"):
        raise ValueError("continue_final_message needs the last message to be the assistant's")
    kwargs = dict(chat_template_kwargs or {})
    for key in kwargs:
        if not isinstance(key, str) or key in CHAT_TEMPLATE_RESERVED_KWARGS:
            raise ValueError(f"chat_template_kwargs may not set {key!r}")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"the tokenizer {tokenizer.name_or_path!r} has no chat template: "
                         "send a plain-text prompt (completions) instead of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise ValueError(f"messages[{i}] must be a mapping with a 'role', got {message!r}")
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if tools:
        kwargs["tools"] = list(tools)
    text = tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def bad_words_token_ids(tokenizer: Optional[PreTrainedTokenizerBase], words: Sequence[str]) -> list[list[int]]:
    """The token sequences SamplingParams.bad_words forbids (vLLM's rule): each word encoded on its
    own and after a space (as it reads mid-text), without special tokens, repeats dropped.
    Raises RequestError without a tokenizer."""
    if tokenizer is None:
        from pagedserve.errors import RequestError

        raise RequestError("bad_words needs a tokenizer, and this model directory has none", "bad_words",
                           "no_tokenizer")
    sequences: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def eos_token_ids(tokenizer: PreTrainedTokenizerBase,
                  model_config_eos: Optional[Union[int, Iterable[int]]]) -> list[int]:
    """The model config's EOS ids (int or list) followed by the tokenizer's, without repeats."""
    if model_config_eos is None:
        configured: list[int] = []
    elif isinstance(model_config_eos, int):
        configured = [model_config_eos]
    else:
        configured = list(model_config_eos)
    if tokenizer.eos_token_id is not None:
        configured.append(tokenizer.eos_token_id)
    return list(dict.fromkeys(configured))


def prompt_token_ids(tokenizer: Optional[PreTrainedTokenizerBase],
                     prompt: PromptType) -> tuple[Optional[str], list[int]]:
    """(text, token ids) of a prompt given as text, token ids or a dict with "prompt_token_ids" or "prompt";
    RequestError for one the engine cannot take."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" not in prompt:
            raise RequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("this model directory has no tokenizer: pass prompt token ids", "prompt",
                               "no_tokenizer")
        return prompt, encode_prompt(tokenizer, check_text(prompt))
    if isinstance(prompt, (list, tuple, np.ndarray)):
        return None, [int(t) if isinstance(t, np.integer) else t for t in prompt]
    raise RequestError(f"a prompt is a string, a list of token ids or a dict, not {type(prompt).__name__}",
                       "prompt", "invalid_type")
