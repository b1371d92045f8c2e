"""The agent frameworks users bring, against the real server (default model, CPU), offline: LangChain's
ChatOpenAI (with_structured_output by json_schema, function_calling and json_mode; bind_tools with
tool_choice any, required, a named tool and auto; a multi-turn conversation with a ToolMessage; a
streamed tool call) and litellm's completion (response_format as a json_schema dict, a pydantic class and
json_object; tools with tool_choice required and named; streaming). The model is tiny: every assertion
rests on what the server's grammar guarantees, not on the model's judgement."""

from __future__ import annotations

import json
import os

# litellm fetches its model cost map (and, for some providers, other JSON) from GitHub at import unless told
# to use the copies it ships: set before the import below.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
os.environ["LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS"] = "True"
os.environ["LITELLM_LOCAL_BLOG_POSTS"] = "True"
# LangChain traces to LangSmith only when asked to; make sure it is not.
os.environ["LANGSMITH_TRACING"] = "false"
os.environ["LANGCHAIN_TRACING_V2"] = "false"

from typing import Literal  # noqa: E402

import jsonschema  # noqa: E402
import litellm  # noqa: E402
import pytest  # noqa: E402
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from server_process import ServerProcess  # noqa: E402

litellm.telemetry = False
litellm.drop_params = False  # send what the test asks for: a refused field must show as a 400

ASK_PERSON = "Give me a person as JSON with a name and an age."
ASK_WEATHER = "What is the weather in Paris right now?"
MAX_TOKENS = 80


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


@tool
def get_time(timezone: str) -> str:
    """Local time in a timezone such as Europe/Paris."""
    return "12:00"


PERSON_SCHEMA = {**Person.model_json_schema(), "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-num-seqs", "8") as s:
        yield s


@pytest.fixture(scope="module")
def llm(server, model) -> ChatOpenAI:
    return ChatOpenAI(base_url=server.base_url, api_key="unused", model=model, temperature=0,
                      max_tokens=MAX_TOKENS, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def litellm_kwargs(server, model) -> dict:
    return dict(model="openai/" + model, api_base=server.base_url, api_key="unused", temperature=0,
                max_tokens=MAX_TOKENS, num_retries=0, timeout=300)


# ---------------------------------------------------------------------------------------------- LangChain
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(llm, method):
    result = llm.with_structured_output(Person, method=method, include_raw=True).invoke(ASK_PERSON)
    assert result["parsing_error"] is None
    assert isinstance(result["parsed"], Person)
    if method == "function_calling":
        assert [call["name"] for call in result["raw"].tool_calls] == ["Person"]


def test_langchain_structured_output_json_mode(llm):
    # json_mode enforces JSON, not the schema: the guarantee is a JSON object.
    result = llm.with_structured_output(Person, method="json_mode", include_raw=True).invoke(
        ASK_PERSON + " Answer in JSON.")
    assert result["parsing_error"] is None
    assert isinstance(json.loads(result["raw"].content), dict)


@pytest.mark.parametrize("tool_choice", ["any", "required"])
def test_langchain_bind_tools_required(llm, tool_choice):
    # parallel_tool_calls=False: the grammar allows one call, so max_tokens cannot cut a list of them short.
    message = llm.bind_tools([GetWeather, get_time], tool_choice=tool_choice,
                             parallel_tool_calls=False).invoke(ASK_WEATHER)
    assert isinstance(message, AIMessage) and not message.invalid_tool_calls
    assert len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call["id"] and call["name"] in ("GetWeather", "get_time")
    if call["name"] == "GetWeather":
        GetWeather.model_validate(call["args"])
    else:
        get_time.args_schema.model_validate(call["args"])


@pytest.mark.parametrize("name", ["GetWeather", "get_time"])
def test_langchain_bind_tools_named(llm, name):
    message = llm.bind_tools([GetWeather, get_time], tool_choice=name).invoke(ASK_WEATHER)
    assert not message.invalid_tool_calls and [call["name"] for call in message.tool_calls] == [name]
    schema = GetWeather if name == "GetWeather" else get_time.args_schema
    schema.model_validate(message.tool_calls[0]["args"])


def test_langchain_bind_tools_auto(llm):
    message = llm.bind_tools([GetWeather, get_time]).invoke(ASK_WEATHER)
    assert isinstance(message, AIMessage)
    for call in message.tool_calls:  # whatever the model chose, a call it makes is a valid one
        assert call["name"] in ("GetWeather", "get_time")


def test_langchain_multi_turn(llm):
    bound = llm.bind_tools([GetWeather], tool_choice="GetWeather")
    history = [HumanMessage(ASK_WEATHER)]
    first = bound.invoke(history)
    call = first.tool_calls[0]
    history += [first, ToolMessage(content="18 degrees, sunny", tool_call_id=call["id"])]
    reply = llm.bind_tools([GetWeather]).invoke(history)
    assert isinstance(reply, AIMessage)
    assert reply.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


def test_langchain_stream_tool_call(llm):
    bound = llm.bind_tools([GetWeather], tool_choice="any", parallel_tool_calls=False)
    merged, chunks = None, 0
    for chunk in bound.stream(ASK_WEATHER):
        assert isinstance(chunk, AIMessageChunk)
        merged = chunk if merged is None else merged + chunk
        chunks += 1
    assert chunks > 1 and merged.response_metadata["finish_reason"] == "tool_calls"
    assert len(merged.tool_call_chunks) == 1 and not merged.invalid_tool_calls
    assert merged.tool_calls[0]["name"] == "GetWeather" and merged.tool_calls[0]["id"]
    GetWeather.model_validate_json(merged.tool_call_chunks[0]["args"])


# ---------------------------------------------------------------------------------------------- litellm
@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}},
    Person,
], ids=["json_schema", "pydantic"])
def test_litellm_json_schema(litellm_kwargs, response_format):
    r = litellm.completion(messages=[{"role": "user", "content": ASK_PERSON}], response_format=response_format,
                           **litellm_kwargs)
    assert r.choices[0].finish_reason == "stop"
    content = r.choices[0].message.content
    jsonschema.validate(json.loads(content), PERSON_SCHEMA)
    Person.model_validate_json(content)


def test_litellm_json_object(litellm_kwargs):
    r = litellm.completion(messages=[{"role": "user", "content": ASK_PERSON}],
                           response_format={"type": "json_object"}, **litellm_kwargs)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_litellm_json_schema_streaming(litellm_kwargs):
    stream = litellm.completion(messages=[{"role": "user", "content": ASK_PERSON}], response_format=Person,
                                stream=True, **litellm_kwargs)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    Person.model_validate_json(text)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_litellm_tools(litellm_kwargs, tool_choice):
    r = litellm.completion(messages=[{"role": "user", "content": ASK_WEATHER}], tools=[WEATHER_TOOL],
                           tool_choice=tool_choice, parallel_tool_calls=False, **litellm_kwargs)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].id and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER_TOOL["function"]["parameters"])
