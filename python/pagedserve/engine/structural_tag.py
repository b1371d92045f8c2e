"""Structural tags (vLLM's `structured_outputs.structural_tag`): checking one and putting it in xgrammar's form.

A structural tag lets the output be free text until a trigger string appears; from there the text must
be one of the tags that trigger begins (`begin`, then content under a grammar, then `end`), after which
it is free again. Two forms are accepted, as vLLM accepts them:

- the legacy form {"type": "structural_tag", "structures": [{"begin", "schema", "end"}, ...],
  "triggers": [...]}, each schema a JSON schema, each trigger a prefix of some begin (tool calling
  builds this one);
- xgrammar's form {"type": "structural_tag", "format": {...}}, passed through to xgrammar, which checks it.

Either may come as a dict or as JSON text. `parse` checks the shape when the params are built, so a
malformed tag is refused before the request reaches the engine; `to_xgrammar` gives the single form that
xgrammar's `compile_structural_tag` takes (the legacy form becomes a "triggered_tags" format, exactly
what xgrammar's own deprecated legacy entry point builds).
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.errors import RequestError


def _invalid(message: str) -> RequestError:
    return RequestError(f"structured_outputs.structural_tag: {message}", "structured_outputs", "invalid_grammar")


def parse(value: Any) -> dict:
    """The structural tag as a dict (JSON text parsed), its shape checked; RequestError when malformed."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as err:
            raise _invalid(f"not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise _invalid("must be a JSON object")
    if value.get("type", "structural_tag") != "structural_tag":
        raise _invalid(f"type must be \"structural_tag\", got {value.get('type')!r}")
    if "format" in value:
        if "structures" in value or "triggers" in value:
            raise _invalid("give either format or structures and triggers, not both")
        if not isinstance(value["format"], dict) or not isinstance(value["format"].get("type"), str):
            raise _invalid("format must be an object with a type")
        return value
    if "structures" not in value or "triggers" not in value:
        raise _invalid("needs structures and triggers (the legacy form) or format")
    _check_legacy(value["structures"], value["triggers"])
    return value


def _check_legacy(structures: Any, triggers: Any) -> None:
    """Each structure a {begin, schema, end} with a JSON-schema object; each trigger a non-empty string
    that begins some structure, and each begin starting with a trigger (else the tag could never be
    entered, which xgrammar also refuses)."""
    if not isinstance(structures, list) or not structures:
        raise _invalid("structures must be a non-empty list")
    if (not isinstance(triggers, list) or not triggers
            or not all(isinstance(t, str) and t for t in triggers)):
        raise _invalid("triggers must be a non-empty list of non-empty strings")
    for i, item in enumerate(structures):
        if not isinstance(item, dict):
            raise _invalid(f"structures[{i}] must be an object with begin, schema and end")
        missing = [k for k in ("begin", "schema", "end") if k not in item]
        if missing:
            raise _invalid(f"structures[{i}] lacks {', '.join(missing)}")
        if not isinstance(item["begin"], str) or not item["begin"]:
            raise _invalid(f"structures[{i}].begin must be a non-empty string")
        if not isinstance(item["end"], str):
            raise _invalid(f"structures[{i}].end must be a string")
        _schema(item["schema"], i)
        if not any(item["begin"].startswith(t) for t in triggers):
            raise _invalid(f"structures[{i}].begin {item['begin']!r} starts with none of the triggers")
    begins = [item["begin"] for item in structures]
    for trigger in triggers:
        if not any(b.startswith(trigger) for b in begins):
            raise _invalid(f"the trigger {trigger!r} is a prefix of no structure's begin")


def _schema(schema: Any, index: int) -> dict:
    """A structure's JSON schema as a dict (JSON text parsed, as xgrammar's legacy items allow)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as err:
            raise _invalid(f"structures[{index}].schema is not valid JSON: {err}") from None
    if not isinstance(schema, dict):
        raise _invalid(f"structures[{index}].schema must be a JSON schema object")
    return schema


def to_xgrammar(tag: dict) -> str:
    """The JSON text of `tag` (as `parse` returned it) in xgrammar's {"type", "format"} form."""
    if "format" in tag:
        return json.dumps({"type": "structural_tag", "format": tag["format"]})
    tags = [{"type": "tag", "begin": s["begin"], "end": s["end"],
             "content": {"type": "json_schema", "json_schema": _schema(s["schema"], i)}}
            for i, s in enumerate(tag["structures"])]
    return json.dumps({"type": "structural_tag",
                       "format": {"type": "triggered_tags", "triggers": list(tag["triggers"]), "tags": tags}})
