"""structured_outputs.structural_tag: free text until a trigger, then begin + schema-constrained JSON + end.

Covers both forms vLLM accepts (the legacy {"structures", "triggers"} one that tool calling builds, and
xgrammar's {"format"} one), their validation before queueing, the grammar's token acceptance, and
end-to-end generation with the default model (CPU). The JSON inside the tags is checked with jsonschema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedserve import LLM, SamplingParams, StructuredOutputsParams
from pagedserve.errors import RequestError

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
BEGIN = '<tool_call>\n{"name": "get_weather", "arguments": '
END = "}\n</tool_call>"
TOOL_TAG = {"type": "structural_tag", "structures": [{"begin": BEGIN, "schema": WEATHER, "end": END}],
            "triggers": ["<tool_call>"]}


def _call(arguments: str, before: str = "Let me check. ", after: str = "") -> str:
    return f"{before}{BEGIN}{arguments}{END}{after}"


def _arguments(text: str) -> list[dict]:
    """The arguments objects of the tool calls in `text` (each between BEGIN and END)."""
    calls = []
    for part in text.split(BEGIN)[1:]:
        assert END in part, text
        calls.append(json.loads(part.split(END)[0]))
    return calls


@pytest.fixture(scope="module")
def llm(default_model_path):
    return LLM(str(default_model_path), dtype="float32", device="cpu", seed=0, max_model_len=1024)


def _accepts(llm, tag, text: str, eos: bool = False) -> bool:
    """Whether a fresh matcher of the tag's grammar accepts every token of `text` (then EOS, when asked)."""
    engine = llm.llm_engine
    matcher = engine.grammars.compile(StructuredOutputsParams(structural_tag=tag)).new_matcher()
    tokens = engine.tokenizer.encode(text, add_special_tokens=False)
    if eos:
        tokens = tokens + [engine.eos_token_ids[0]]
    return all(matcher.accept_token(t) for t in tokens)


# ---------------------------------------------------------------- the params
@pytest.mark.parametrize("form", ["dict", "json text"])
def test_legacy_form_is_accepted(form):
    value = TOOL_TAG if form == "dict" else json.dumps(TOOL_TAG)
    so = StructuredOutputsParams(structural_tag=value)
    assert so.kind == "structural_tag"
    assert so.structural_tag == TOOL_TAG  # kept parsed
    assert so.cache_key() == StructuredOutputsParams(structural_tag=TOOL_TAG).cache_key()
    SamplingParams(structured_outputs={"structural_tag": value})


def test_cache_key_covers_the_tag():
    other = json.loads(json.dumps(TOOL_TAG))
    other["structures"][0]["schema"]["properties"]["city"]["maxLength"] = 10
    keys = {StructuredOutputsParams(structural_tag=t).cache_key() for t in (TOOL_TAG, other)}
    assert len(keys) == 2


def _legacy(**changes) -> dict:
    tag = json.loads(json.dumps(TOOL_TAG))
    tag.update(changes)
    return tag


@pytest.mark.parametrize("value,message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ({"type": "json_schema", "structures": [], "triggers": []}, "type must be"),
    ({"type": "structural_tag"}, "needs structures and triggers"),
    ({"structures": TOOL_TAG["structures"]}, "needs structures and triggers"),
    (_legacy(structures=[]), "structures must be a non-empty list"),
    (_legacy(triggers=[]), "triggers must be a non-empty list"),
    (_legacy(triggers=["<tool_call>", "<function="]), "'<function=' is a prefix of no structure"),
    (_legacy(triggers=["<function="]), "starts with none of the triggers"),
    (_legacy(structures=[{"begin": BEGIN, "end": END}]), "lacks schema"),
    (_legacy(structures=[{"begin": BEGIN, "schema": [1], "end": END}]), "must be a JSON schema object"),
    (_legacy(structures=[{"begin": BEGIN, "schema": "{bad", "end": END}]), "schema is not valid JSON"),
    (_legacy(structures=[{"begin": "", "schema": {}, "end": END}]), "begin must be a non-empty string"),
    ({"type": "structural_tag", "format": "x"}, "format must be an object"),
    (_legacy(format={"type": "any_text"}), "not both"),
])
def test_malformed_tags_are_refused_at_construction(value, message):
    with pytest.raises(RequestError, match=message) as err:
        StructuredOutputsParams(structural_tag=value)
    assert err.value.field == "structured_outputs"
    assert err.value.code == "invalid_grammar"


def test_uncompilable_format_is_refused_before_queueing(llm):
    so = StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {"type": "no_such_format"}})
    with pytest.raises(RequestError, match="structural tag cannot be compiled: xgrammar: .*no_such_format") as err:
        llm.generate(["x"], SamplingParams(structured_outputs=so), use_tqdm=False)
    assert (err.value.field, err.value.code) == ("structured_outputs", "invalid_grammar")
    assert not llm.llm_engine.has_unfinished_requests()


# ---------------------------------------------------------------- the grammar
def test_tool_call_tag_accepts_valid_calls(llm):
    assert llm.llm_engine.grammars.compile(StructuredOutputsParams(structural_tag=TOOL_TAG)).backend == "xgrammar"
    valid = '{"city": "Paris", "unit": "celsius"}'
    assert _accepts(llm, TOOL_TAG, "Just text, no call at all.", eos=True)
    assert _accepts(llm, TOOL_TAG, _call(valid), eos=True)
    assert _accepts(llm, TOOL_TAG, _call(valid, after=" and again " + _call(valid, before="")), eos=True)
    assert _accepts(llm, TOOL_TAG, _call(valid, before=""), eos=True)


@pytest.mark.parametrize("text", [
    _call('{"city": "Paris"}'),  # a required argument missing
    _call('{"city": "Paris", "unit": "kelvin"}'),  # not in the enum
    _call('{"city": "Paris", "unit": "celsius", "extra": 1}'),  # additionalProperties false
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',  # a begin no structure has
    _call('{"city": "Paris", "unit": "celsius"}').replace("</tool_call>", "</tool>"),  # a wrong end
])
def test_tool_call_tag_rejects_invalid_calls(llm, text):
    assert not _accepts(llm, TOOL_TAG, text)


def test_eos_is_refused_inside_a_tag(llm):
    assert not _accepts(llm, TOOL_TAG, BEGIN + '{"city": "Pa', eos=True)


# ---------------------------------------------------------------- end to end
_SHOT = ('User: What is the weather in {city}?\nAssistant: <tool_call>\n{{"name": "get_weather", "arguments": '
         '{{"location": "{city}", "units": "C"}}}}\n</tool_call>\n')
FEW_SHOT = _SHOT.format(city="Paris") + _SHOT.format(city="Oslo") + "User: What is the weather in Rome?\nAssistant:"


def test_tool_call_generated_under_the_legacy_tag(llm):
    """The few-shot prompt leads the model to call the tool with the examples' (wrong) argument names;
    under the tag, the arguments follow the function's schema instead."""
    params = dict(max_tokens=48, temperature=0.0)
    free = llm.generate([FEW_SHOT], SamplingParams(**params), use_tqdm=False)[0].outputs[0].text
    assert BEGIN in free and '"location"' in free  # what the model does on its own
    so = StructuredOutputsParams(structural_tag=json.dumps(TOOL_TAG))
    out = llm.generate([FEW_SHOT], SamplingParams(structured_outputs=so, **params), use_tqdm=False)[0].outputs[0]
    calls = _arguments(out.text)
    assert calls, out.text
    for arguments in calls:
        jsonschema.validate(arguments, WEATHER)
    assert _accepts(llm, TOOL_TAG, out.text)


def test_free_text_is_left_alone_without_a_trigger(llm):
    params = dict(max_tokens=16, temperature=0.0)
    prompt = "Hello, who are you?"
    free = llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs[0].text
    so = StructuredOutputsParams(structural_tag=TOOL_TAG)
    tagged = llm.generate([prompt], SamplingParams(structured_outputs=so, **params), use_tqdm=False)[0]
    assert "<tool_call>" not in free and tagged.outputs[0].text == free


def test_xgrammar_format_forces_a_tag(llm):
    """xgrammar's own form: at_least_one makes the tag mandatory even where the model would not call."""
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<tool_call>"], "at_least_one": True, "stop_after_first": True,
        "tags": [{"type": "tag", "begin": BEGIN, "content": {"type": "json_schema", "json_schema": WEATHER},
                  "end": END}]}}
    so = StructuredOutputsParams(structural_tag=json.dumps(tag))
    outs = llm.generate(["Hello, who are you?", "Name a city."],
                        SamplingParams(structured_outputs=so, max_tokens=96, temperature=0.8, seed=3, n=2),
                        use_tqdm=False)
    finished = [c for out in outs for c in out.outputs if c.finish_reason == "stop"]
    assert finished
    for out in outs:
        for c in out.outputs:
            assert c.text.startswith(BEGIN), c.text
            assert _accepts(llm, tag, c.text, eos=c.finish_reason == "stop")
    for c in finished:  # stop_after_first: the output ends with the tag
        assert c.text.endswith(END)
        (arguments,) = _arguments(c.text)
        jsonschema.validate(arguments, WEATHER)


# ---------------------------------------------------------------- llguidance fallback
# The same function with what xgrammar refuses (see test_grammar_fallback.py): an optional integer whose
# bounds are not whole numbers (0.2.8 and 0.2.9), and its unit through a JSON pointer with an escaped "/"
# ("~1", which 0.2.8 could not follow): llguidance compiles the legacy tag instead.
WEATHER_REF = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "unit": {"$ref": "#/$defs/temperature~1unit"},
                                               "days": {"type": "integer", "minimum": 0.5, "maximum": 9.5}},
               "required": ["city", "unit"], "additionalProperties": False,
               "$defs": {"temperature/unit": {"enum": ["celsius", "fahrenheit"]}}}
REF_TAG = {"type": "structural_tag", "structures": [{"begin": BEGIN, "schema": WEATHER_REF, "end": END}],
           "triggers": ["<tool_call>"]}


def test_legacy_tag_falls_back_to_llguidance(llm):
    assert llm.llm_engine.grammars.compile(StructuredOutputsParams(structural_tag=REF_TAG)).backend == "llguidance"
    assert _accepts(llm, REF_TAG, "No call.", eos=True)
    assert _accepts(llm, REF_TAG, _call('{"city": "Paris", "unit": "celsius"}', after=" ok"), eos=True)
    assert not _accepts(llm, REF_TAG, _call('{"city": "Paris", "unit": "kelvin"}'))
    assert not _accepts(llm, REF_TAG, BEGIN + '{"city": "Pa', eos=True)
    so = StructuredOutputsParams(structural_tag=REF_TAG)
    out = llm.generate([FEW_SHOT], SamplingParams(structured_outputs=so, max_tokens=48, temperature=0.0),
                       use_tqdm=False)[0].outputs[0]
    calls = _arguments(out.text)
    assert calls, out.text
    for arguments in calls:
        jsonschema.validate(arguments, WEATHER_REF)


def test_xgrammar_format_is_not_given_to_llguidance(llm):
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [
        {"type": "tag", "begin": BEGIN, "content": {"type": "json_schema", "json_schema": WEATHER_REF}, "end": END}]}}
    with pytest.raises(RequestError, match="xgrammar: .*; llguidance: .*legacy"):
        llm.llm_engine.grammars.compile(StructuredOutputsParams(structural_tag=tag))
