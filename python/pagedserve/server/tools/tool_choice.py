"""What a chat request's `tools` and `tool_choice` ask of the engine.

  none          the tools are shown to the template, the reply is plain content
  auto          the model may call: its text is read by the family's parser; where that format
                has an opening tag (hermes), a structural tag makes whatever follows the tag a
                valid call of one of the tools (text elsewhere stays free)
  required      the grammar makes the reply a JSON array of one or more {"name", "arguments"}
                objects, each the arguments schema of its function
  {"type": "function", "function": {"name": f}}
                the grammar makes the reply f's arguments

so "required" and a named function always produce valid calls, whatever the model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional

from pagedserve.server.errors import bad_request
from pagedserve.server.tools.parsers import HermesParser, NamedParser, RequiredParser, ToolParser

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict]  # as the template receives them (OpenAI's shape)
    choice: str  # "none", "auto", "required" or "named"
    parser: Optional[ToolParser]  # None: the reply is content
    grammar: Optional[dict]  # a structured_outputs spec (vLLM's names) enforcing the choice, or None
    max_calls: Optional[int]


def check_tools(tools: list) -> dict[str, dict]:
    """The tools by name, each checked: {"type": "function", "function": {name, description?,
    parameters?, strict?}}."""
    by_name: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) != {"type", "function"}:
            raise bad_request(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        fn = tool["function"]
        if not isinstance(fn, dict):
            raise bad_request(f"{where}.function must be an object", "tools")
        unknown = sorted(set(fn) - _FUNCTION_KEYS)
        if unknown:
            raise bad_request(f"{where}.function: unsupported key(s) {', '.join(unknown)}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'", "tools")
        if name in by_name:
            raise bad_request(f"{where}: the function name {name!r} is used twice", "tools")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise bad_request(f"{where}.function.parameters must be a JSON schema object", "tools")
        if "description" in fn and not isinstance(fn["description"], str):
            raise bad_request(f"{where}.function.description must be a string", "tools")
        by_name[name] = fn
    return by_name


def _choice(tool_choice, by_name: dict[str, dict]) -> tuple[str, Optional[str]]:
    if tool_choice is None:
        return ("auto" if by_name else "none"), None
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in by_name:
            raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools",
                              "tool_choice")
        return "named", name
    raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", '
                      '"function": {"name": ...}}', "tool_choice")


def plan_tools(tools: Optional[list], tool_choice, parallel_tool_calls: Optional[bool],
               auto_parser: ToolParser, user_grammar: bool) -> Optional[ToolPlan]:
    """The plan for a request's tool fields, or None when it has none. `user_grammar`: the request
    constrains its output itself (response_format, structured_outputs, guided_*)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        if parallel_tool_calls is not None:
            raise bad_request("parallel_tool_calls needs tools", "parallel_tool_calls")
        return None
    by_name = check_tools(tools)
    choice, name = _choice(tool_choice, by_name)
    max_calls = 1 if parallel_tool_calls is False else None
    if choice in ("required", "named") and user_grammar:
        raise bad_request(f"tool_choice {choice!r} constrains the output itself: leave out response_format, "
                          "structured_outputs and guided_*", "tool_choice")
    if choice == "none":
        return ToolPlan(tools, choice, None, None, max_calls)
    if choice == "named":
        schema = by_name[name].get("parameters") or ANY_OBJECT
        return ToolPlan(tools, choice, NamedParser(name), _compact({"json": schema}), max_calls)
    if choice == "required":
        return ToolPlan(tools, choice, RequiredParser(), _compact({"json": required_schema(by_name, max_calls)}),
                        max_calls)
    grammar = None if user_grammar else auto_grammar(auto_parser, by_name)
    return ToolPlan(tools, choice, auto_parser, grammar, max_calls)


def _compact(spec: dict) -> dict:
    # Without free whitespace: small models otherwise loop on newlines inside the JSON (seen with
    # SmolLM2-135M: 200 tokens of indentation and no call).
    return {**spec, "disable_any_whitespace": True}


def required_schema(by_name: dict[str, dict], max_calls: Optional[int]) -> dict:
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [name]},
                             "arguments": fn.get("parameters") or ANY_OBJECT},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name, fn in by_name.items()]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


def auto_grammar(parser: ToolParser, by_name: dict[str, dict]) -> Optional[dict]:
    """A structural tag making each call after the parser's opening tag valid; None for formats
    without a tag that can open a call (their text is parsed as it comes)."""
    if not isinstance(parser, HermesParser):
        return None
    structures = [{"begin": f'{parser.START}\n{{"name": {json.dumps(name)}, "arguments": ',
                   "schema": fn.get("parameters") or ANY_OBJECT, "end": f"}}\n{parser.END}"}
                  for name, fn in by_name.items()]
    return {"structural_tag": {"type": "structural_tag", "structures": structures, "triggers": [parser.START]}}
