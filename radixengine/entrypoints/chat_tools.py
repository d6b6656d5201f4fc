"""Tools on /v1/chat/completions, the request side (SGLang's serving_chat): the checks of `tools`
and `tool_choice`, the tools the chat template shows, and the grammar that forces the calls of
`tool_choice: required` or a named function."""

from __future__ import annotations

import json
import re

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from radixengine.entrypoints.openai_protocol import ChatCompletionRequest, ToolChoice
from radixengine.function_call.function_call_parser import TOOL_CALL_PARSERS
from radixengine.function_call.schema_constraint import tool_call_constraint
from radixengine.managers.request_errors import RequestError
from radixengine.managers.tokenizer_manager import TokenizerManager

TOOL_CHOICES = ("none", "auto", "required")
FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule
# Sampling fields that constrain the output: a forced tool call cannot share the request with one.
CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")


def tool_choice_of(req: ChatCompletionRequest) -> str | ToolChoice:
    """The request's tool_choice; unset: `auto` with tools, else `none` (OpenAI's default)."""
    if req.tool_choice is not None:
        return req.tool_choice
    return "auto" if req.tools else "none"


def tools_active(req: ChatCompletionRequest) -> bool:
    return bool(req.tools) and tool_choice_of(req) != "none"


def forced_function(req: ChatCompletionRequest) -> str | None:
    choice = tool_choice_of(req)
    return choice.function.name if isinstance(choice, ToolChoice) else None


def is_forced(req: ChatCompletionRequest) -> bool:
    """Whether the request must call a tool (`required` or a named function)."""
    return bool(req.tools) and (tool_choice_of(req) == "required" or forced_function(req) is not None)


def check_tools(req: ChatCompletionRequest) -> None:
    """Every bad tool definition or choice is a 400 naming its field (SGLang's
    `_validate_request` and OpenAI's name rule)."""
    seen: dict[str, int] = {}
    for i, tool in enumerate(req.tools or []):
        name = tool.function.name
        if not FUNCTION_NAME.match(name):
            raise RequestError(
                f"tools[{i}].function.name must be 1 to 64 letters, digits, underscores or dashes; got {name!r}",
                param=f"tools[{i}].function.name",
            )
        if name in seen:
            raise RequestError(
                f"tools[{i}].function.name {name!r} is also the name of tools[{seen[name]}]",
                param=f"tools[{i}].function.name",
            )
        seen[name] = i
        _check_parameters(i, tool.function.parameters)
    _check_tool_choice(req, seen)


def _check_parameters(i: int, schema: dict | None) -> None:
    param = f"tools[{i}].function.parameters"
    if schema is None:
        return
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        raise RequestError(f"{param} is not a valid JSON schema: {e.message}", param=param) from None
    except RecursionError:
        raise RequestError(f"{param} is nested too deeply or refers to itself", param=param) from None
    if schema.get("type", "object") != "object":
        raise RequestError(
            f"{param} must describe a JSON object (the call's arguments); got type {schema['type']!r}",
            param=param,
        )


def _check_tool_choice(req: ChatCompletionRequest, names: dict[str, int]) -> None:
    choice = req.tool_choice
    if isinstance(choice, str) and choice not in TOOL_CHOICES:
        raise RequestError(
            f'tool_choice must be none, auto, required or {{"type": "function", "function": {{"name": ...}}}}; '
            f"got {choice!r}",
            param="tool_choice",
        )
    if choice == "required" and not req.tools:
        raise RequestError("tool_choice required needs tools", param="tool_choice")
    if isinstance(choice, ToolChoice) and choice.function.name not in names:
        raise RequestError(
            f"tool_choice names the function {choice.function.name!r}, which is not in tools",
            param="tool_choice.function.name",
        )


def template_tools(req: ChatCompletionRequest) -> list[dict] | None:
    """The tools the chat template renders (the named one alone under a named tool_choice; none
    under `none`), as OpenAI's JSON."""
    if not tools_active(req):
        return None
    name = forced_function(req)
    return [t.model_dump(exclude_none=True) for t in req.tools if name is None or t.function.name == name]


def forced_call_parser(server_args) -> str | None:
    """The parser whose format a forced call's grammar holds the output to: the server's
    `--tool-call-parser` where it has a structural tag and the grammar backend (xgrammar) takes
    one; else None, the JSON array of calls."""
    parser = server_args.tool_call_parser
    if parser is None or server_args.grammar_backend != "xgrammar":
        return None
    return parser if TOOL_CALL_PARSERS[parser]().supports_structural_tag() else None


def add_tool_params(tm: TokenizerManager, req: ChatCompletionRequest, params: dict) -> None:
    """Sampling parameters of a request with tools: special tokens kept in the text (a format's
    markers may be special tokens, as SGLang does), and for a forced call its grammar: the
    parser's structural tag, or the JSON array schema of the calls (a 400 naming `tools` when
    the grammar backend cannot use it)."""
    if not tools_active(req):
        return
    params["skip_special_tokens"] = False
    if not is_forced(req):
        return
    taken = [name for name in CONSTRAINT_FIELDS if params.get(name) is not None]
    if taken:
        raise RequestError(
            f"tool_choice {json.dumps(_choice_json(req))} forces a grammar and cannot be combined with "
            f"{taken[0]} (constrained decoding)",
            param="tool_choice",
        )
    parser = forced_call_parser(tm.server_args)
    detector = TOOL_CALL_PARSERS[parser]() if parser else None
    compact = tm.server_args.constrained_json_disable_any_whitespace
    name, value = tool_call_constraint(
        detector, req.tools, forced_function(req), req.parallel_tool_calls, compact
    )
    tm.check_grammar(name, value, "tools")
    params[name] = value


def _choice_json(req: ChatCompletionRequest):
    choice = tool_choice_of(req)
    return choice.model_dump() if isinstance(choice, ToolChoice) else choice


def template_tool_calls(i: int, message) -> list[dict] | None:
    """An assistant message's calls as chat templates take them: the arguments an object
    (SGLang's `normalize_assistant_tool_call_arguments`)."""
    if not message.tool_calls:
        return None
    calls = []
    for j, call in enumerate(message.tool_calls):
        arguments = call.function.arguments
        if isinstance(arguments, str):
            param = f"messages[{i}].tool_calls[{j}].function.arguments"
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError) as e:
                raise RequestError(f"{param} must be JSON text: {e}", param=param) from None
            if not isinstance(arguments, dict):
                raise RequestError(f"{param} must be a JSON object", param=param)
        entry = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
        if call.id is not None:
            entry["id"] = call.id
        calls.append(entry)
    return calls
