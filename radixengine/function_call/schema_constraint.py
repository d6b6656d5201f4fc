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


def tool_schema_defs(tools: list) -> dict:
    """The `$defs` of every tool's parameters, merged; a name defined twice differently is a
    ValueError (one array schema cannot hold both)."""
    defs: dict = {}
    for tool in tools:
        for name, schema in (tool.function.parameters or {}).get("$defs", {}).items():
            if name in defs and defs[name] != schema:
                raise ValueError(f"the tools define $defs {name!r} differently")
            defs[name] = schema
    return defs


def _call_schema(tool) -> dict:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": [tool.function.name]},
            "parameters": parameters_schema(tool),
        },
        "required": ["name", "parameters"],
    }


def json_array_schema(tools: list, forced_function: str | None, parallel_tool_calls: bool) -> dict:
    """SGLang's `get_json_schema_constraint`: one or more calls (exactly one without
    `parallel_tool_calls`) of the named function, or of any of `tools`."""
    if forced_function is not None:
        tool = next(t for t in tools if t.function.name == forced_function)
        schema = {"type": "array", "minItems": 1, "items": _call_schema(tool)}
        defs = tool_schema_defs([tool])
    else:
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": [_call_schema(t) for t in tools]}}
        defs = tool_schema_defs(tools)
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
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
    where it has one, else the JSON array schema."""
    if detector is not None and detector.supports_structural_tag():
        tag = structural_tag(detector, tools, forced_function, parallel_tool_calls, compact_json)
        return "structural_tag", json.dumps(tag)
    return "json_schema", json.dumps(json_array_schema(tools, forced_function, parallel_tool_calls))
