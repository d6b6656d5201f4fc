"""The grammars that force tool calls (`tool_choice` required or a named function), as SGLang
builds them: a JSON schema of an array of `{"name", "parameters"}` calls (any parser), or a
structural tag in the parser's own format (SGLang's `get_structure_constraint`).

`tools` are objects with `.function.name` and `.function.parameters` (a JSON schema or None)."""

from __future__ import annotations

import json

from radixengine.function_call.base_format_detector import BaseFormatDetector

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def parameters_schema(tool) -> dict:
    return tool.function.parameters or EMPTY_PARAMETERS


# Keywords whose values are data, not schemas: a `$ref` inside them is not a reference.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def defs_key(tool) -> str:
    """Where a tool's parameters sit in the array schema's `$defs` (names are unique and hold no
    character a JSON pointer escapes)."""
    return f"tool-{tool.function.name}"


def rebase_refs(schema: object, base: str) -> object:
    """`schema` with every local `$ref` (`#`, `#/$defs/...`, `#/definitions/...`,
    `#/properties/...`) made relative to `base`, the JSON pointer where the schema now sits, so
    that it means what it meant as a root. Other refs (other documents, `#anchor`s) are kept."""
    if isinstance(schema, list):
        return [rebase_refs(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = rebase_refs(value, base)
    return out


def _hoisted(tools: list) -> tuple[dict[str, dict], dict]:
    """Each tool's parameters moved whole into the array schema's `$defs` (its own `$defs`,
    `definitions` and refs to its root or properties kept working), and the `$ref` to each."""
    defs, refs = {}, {}
    for tool in tools:
        key = defs_key(tool)
        defs[key] = rebase_refs(parameters_schema(tool), f"#/$defs/{key}")
        refs[tool.function.name] = {"$ref": f"#/$defs/{key}"}
    return refs, defs


def _call_schema(tool, parameters: dict) -> dict:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": [tool.function.name]},
            "parameters": parameters,
        },
        "required": ["name", "parameters"],
    }


def json_array_schema(tools: list, forced_function: str | None, parallel_tool_calls: bool) -> dict:
    """SGLang's `get_json_schema_constraint`: one or more calls (exactly one without
    `parallel_tool_calls`) of the named function, or of any of `tools`. Each tool's parameters
    are referenced from `$defs`, where they sit whole with their refs rebased (SGLang hoists only
    `$defs`, which breaks `definitions`, `#/properties/...` and `#` refs)."""
    chosen = [t for t in tools if forced_function is None or t.function.name == forced_function]
    refs, defs = _hoisted(chosen)
    calls = [_call_schema(t, refs[t.function.name]) for t in chosen]
    items = calls[0] if forced_function is not None else {"anyOf": calls}
    schema = {"type": "array", "minItems": 1, "items": items}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    schema["$defs"] = defs
    return schema


def structural_tag(
    detector: BaseFormatDetector,
    tools: list,
    forced_function: str | None,
    parallel_tool_calls: bool,
    compact_json: bool = False,
) -> dict:
    """xgrammar's structural tag: the output opens with a call in the detector's format (of the
    named function, or of any tool), its arguments held to the function's parameters schema;
    without `parallel_tool_calls` it ends after that call. `compact_json`: at most one
    whitespace character in a row inside the arguments (what
    --constrained-json-disable-any-whitespace asks of JSON grammars)."""
    info = detector.structure_info()
    chosen = [t for t in tools if forced_function is None or t.function.name == forced_function]
    tags, triggers = [], []
    for tool in chosen:
        s = info(tool.function.name)
        content = {"type": "json_schema", "json_schema": parameters_schema(tool)}
        if compact_json:
            content["max_whitespace_cnt"] = 1
        tags.append({"type": "tag", "begin": s.begin, "content": content, "end": s.end})
        if s.trigger not in triggers:
            triggers.append(s.trigger)
    return {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": triggers,
            "tags": tags,
            "at_least_one": True,
            "stop_after_first": not parallel_tool_calls,
        },
    }


def tool_call_constraint(
    detector: BaseFormatDetector | None,
    tools: list,
    forced_function: str | None,
    parallel_tool_calls: bool,
    compact_json: bool = False,
) -> tuple[str, str]:
    """(sampling-parameter name, its value) that forces the calls: the parser's structural tag
    where it has one, else the JSON array schema. A named function is called exactly once
    whatever `parallel_tool_calls` (OpenAI's forced function; SGLang's before it read the flag)."""
    parallel_tool_calls = parallel_tool_calls and forced_function is None
    if detector is not None and detector.supports_structural_tag():
        tag = structural_tag(detector, tools, forced_function, parallel_tool_calls, compact_json)
        return "structural_tag", json.dumps(tag)
    return "json_schema", json.dumps(json_array_schema(tools, forced_function, parallel_tool_calls))
