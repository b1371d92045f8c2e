"""Request bodies of the API, as the OpenAI schema defines them, plus the
extra sampling fields vLLM accepts (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, ...).

Unknown fields are 400s naming the field (a null one is dropped): nothing a
client sends is silently ignored. Known fields of the wrong type or out of
range are 400s too. Types are strict: "max_tokens": "2" or "stream": "yes" is refused,
not guessed at (an integer is still a valid number). Integers that cross into
C++ are bounded to int32 here, so they never reach the bindings; ranges that
SamplingParams already enforces are not repeated: its messages reach the
client unchanged.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagedserve.engine.validation import INT32_MAX

# The OpenAI API caps top_logprobs at 20; the engine's max_logprobs may be lower.
MAX_TOP_LOGPROBS = 20
# The seeds a torch.Generator accepts.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class _Body(BaseModel):
    # A field the server does not implement is a 400 naming it (README: "OpenAI and vLLM request fields"),
    # never a 200 that ignored it; an unknown field sent as null means "not set" and is dropped.
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_unknown_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in cls.model_fields}
        return data


class StreamOptions(_Body):
    include_usage: bool = False


class ResponseFormat(_Body):
    type: str
    json_schema: Optional[dict] = None  # {"name", "schema", "strict", "description"} for type "json_schema"


class SamplingFields(_Body):
    """The fields completions and chat completions share."""

    model: Optional[str] = None
    n: int = Field(1, ge=1, le=INT32_MAX)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # Extra sampling fields, as vLLM accepts them.
    top_k: Optional[int] = Field(None, le=INT32_MAX)
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[dict] = None
    guided_json: Optional[Union[str, dict]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


PromptField = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(SamplingFields):
    prompt: PromptField
    max_tokens: Optional[int] = Field(16, ge=0, le=INT32_MAX)  # 0: only with echo (scoring the prompt)
    logprobs: Optional[int] = Field(None, ge=0, le=INT32_MAX)
    echo: bool = False
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=INT32_MAX)  # vLLM's
    suffix: Optional[str] = None
    best_of: Optional[int] = Field(None, ge=1, le=INT32_MAX)


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[dict]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict]] = None  # an assistant's calls, {"id", "type", "function": {name, arguments}}
    tool_call_id: Optional[str] = None  # a tool message: the call it answers


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict] = None


class TokenizeRequest(_Body):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    tools: Optional[list[dict]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict] = None


class DetokenizeRequest(_Body):
    model: Optional[str] = None
    tokens: list[int]
