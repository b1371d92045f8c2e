"""A JSON schema as both grammar backends take it: parsed and checked, every unbounded number bounded
(bounded_numbers), and, for llguidance, as xgrammar reads it in strict mode (as_xgrammar_reads_it: closed
objects and tuples, bounded fractions), so that both backends take and refuse the same texts."""

from __future__ import annotations

import json

from pagedserve.errors import RequestError
from pagedserve.sampling_params import StructuredOutputsParams


def json_schema_text(spec: StructuredOutputsParams) -> str:
    """The spec's JSON schema as JSON text; RequestError when it is not a JSON object (the spec is at
    fault, whichever backend compiles it)."""
    schema = spec.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as err:
            raise RequestError(f"structured_outputs: the json schema is not valid JSON: {err}",
                               "structured_outputs", "invalid_grammar") from None
    if not isinstance(schema, dict):
        raise RequestError("structured_outputs: the json schema must be a JSON object", "structured_outputs",
                           "invalid_grammar")
    return json.dumps(bounded_numbers(schema))


# JSON's interoperable range (RFC 8259 section 6): |n| <= 2**53 - 1. A number or integer the schema leaves
# unbounded gets these bounds, which cap its digits (xgrammar writes bounded ranges with bounded digits, the
# fraction's too): small models otherwise repeat a digit until max_tokens (SmolLM2-135M wrote "age":
# 2018635749668888888... at temperature 0.3). llama.cpp caps digits the same way (16).
SAFE_INTEGER = 2**53 - 1
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def map_subschemas(schema, visit):
    """A copy of `schema` with `visit` applied to each subschema (a dict), innermost first. Values under
    const/enum/default/examples are data and stay as they are; under properties, $defs and the like, the
    names are names (a property may be called "properties" or "type")."""
    if isinstance(schema, list):
        return [map_subschemas(s, visit) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: map_subschemas(sub, visit) for name, sub in value.items()}
        else:
            out[key] = map_subschemas(value, visit)
    visit(out)
    return out


def bounded_numbers(schema):
    """A copy of `schema` where every number or integer subschema without a lower (upper) bound gets
    -SAFE_INTEGER (SAFE_INTEGER)."""
    return map_subschemas(schema, _bound_number)


def _bound_number(subschema: dict) -> None:
    if subschema.get("type") in ("integer", "number"):
        if "minimum" not in subschema and "exclusiveMinimum" not in subschema:
            subschema["minimum"] = -SAFE_INTEGER
        if "maximum" not in subschema and "exclusiveMaximum" not in subschema:
            subschema["maximum"] = SAFE_INTEGER


# xgrammar writes a bounded number's fraction with at most this many digits (and every number is bounded
# here: bounded_numbers); llguidance, told multipleOf 1e-6, takes the same texts.
FRACTION_DIGITS = 6


def as_xgrammar_reads_it(schema):
    """A copy of `schema` that llguidance reads as xgrammar reads the original in strict mode: a subschema
    with properties and nothing said of additional, unevaluated or pattern properties gets
    additionalProperties false; one with prefixItems and no items gets items false; a number without
    multipleOf gets multipleOf 10**-FRACTION_DIGITS (unbounded fractions are where small models loop:
    SmolLM2-135M wrote "temperature": 21.8374659038152221762286... to max_tokens)."""
    return map_subschemas(schema, _as_xgrammar)


def _as_xgrammar(subschema: dict) -> None:
    if subschema.get("type") == "number" and "multipleOf" not in subschema:
        subschema["multipleOf"] = 10.0 ** -FRACTION_DIGITS
    if "properties" in subschema and not {"additionalProperties", "unevaluatedProperties",
                                          "patternProperties"} & subschema.keys():
        subschema["additionalProperties"] = False
    if "prefixItems" in subschema and not {"items", "unevaluatedItems"} & subschema.keys():
        subschema["items"] = False
