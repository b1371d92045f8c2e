"""From a chat request to the engine's prompt: messages (tool calls and tool
results included), tools, and the template that renders them.

The template is the server's --chat-template when given, else the model's;
when the conversation has tools, tool calls or tool results and the model's
template cannot render them (it never mentions tools), pagedserve's shipped
tools template (tools/chatml_tools.jinja) renders it instead of dropping them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional, Union

from pagedserve.server.engine_inputs import checked_text, require_tokenizer
from pagedserve.server.errors import bad_request
from pagedserve.server.protocol import ChatCompletionRequest, ChatMessage, TokenizeRequest

SHIPPED_TOOLS_TEMPLATE = Path(__file__).parent / "tools" / "chatml_tools.jinja"


@lru_cache(maxsize=1)
def shipped_tools_template() -> str:
    return SHIPPED_TOOLS_TEMPLATE.read_text(encoding="utf-8")


@dataclass(frozen=True)
class Template:
    text: Optional[str]  # None: the model's own
    shipped: bool  # pagedserve's tools template (its calls are read by the hermes parser)


def choose_template(server_template: Optional[str], tokenizer, needs_tools: bool) -> Template:
    if server_template is not None:
        return Template(server_template, False)
    own = getattr(tokenizer, "chat_template", None)
    if needs_tools and not (isinstance(own, str) and "tool" in own):
        return Template(shipped_tools_template(), True)
    return Template(None, False)


def uses_tools(body: Union[ChatCompletionRequest, TokenizeRequest]) -> bool:
    return bool(getattr(body, "tools", None)) or any(m.role == "tool" or m.tool_calls for m in body.messages)


def chat_prompt(body: Union[ChatCompletionRequest, TokenizeRequest], tokenizer, template: Template,
                tools: Optional[list] = None) -> dict:
    """The conversation rendered with `template` (and `tools`), as an engine prompt dict."""
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
    dicts = [message_dict(m, i) for i, m in enumerate(body.messages)]
    return {"prompt": None, "prompt_token_ids": _render(tokenizer, dicts, add_generation_prompt, template.text,
                                                        body.continue_final_message, body.chat_template_kwargs,
                                                        tools)}


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, chat_template: Optional[str],
            continue_final_message: bool, chat_template_kwargs: Optional[dict], tools: Optional[list]) -> list[int]:
    from pagedserve.engine.tokenizer import apply_chat_template

    try:
        return apply_chat_template(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                                   chat_template=chat_template, continue_final_message=continue_final_message,
                                   chat_template_kwargs=chat_template_kwargs, tools=tools)
    except ValueError as err:
        raise bad_request(str(err), "messages") from err
    except Exception as err:  # a template may raise anything (jinja2 errors) on a conversation it rejects
        raise bad_request(f"the model's chat template rejected the messages: {err}",
                          "messages") from err


def message_dict(message: ChatMessage, position: int) -> dict:
    """A chat message as templates expect it: text parts joined (other parts refused), an assistant's
    tool calls with their arguments as objects, a tool result with its tool_call_id."""
    where = f"messages[{position}]"
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content: only text parts are supported, got a part "
                                  f"of type {part.get('type')!r}", "messages")
            texts.append(part["text"])
        content = "\n".join(texts)
    out = {"role": message.role, "content": checked_text(content or "", f"{where}.content", "messages")}
    if message.name:
        out["name"] = checked_text(message.name, f"{where}.name", "messages")
    if message.tool_calls:
        if message.role != "assistant":
            raise bad_request(f"{where}: only assistant messages carry tool_calls", "messages")
        out["tool_calls"] = [_tool_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(message.tool_calls)]
    if message.tool_call_id is not None:
        if message.role != "tool":
            raise bad_request(f"{where}: only tool messages carry tool_call_id", "messages")
        out["tool_call_id"] = message.tool_call_id
    return out


def _tool_call(call: dict, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                          "\"arguments\"}}}}", "messages")
    arguments = fn.get("arguments", "{}")
    if isinstance(arguments, str):  # OpenAI sends the arguments as JSON text; templates want the object
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise bad_request(f"{where}.function.arguments is not valid JSON", "messages") from None
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}.function.arguments must be a JSON object", "messages")
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": arguments}}


def check_chat_options(body: ChatCompletionRequest) -> None:
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")


def chat_logprobs(body: ChatCompletionRequest) -> Optional[int]:
    return (body.top_logprobs or 0) if body.logprobs else None
