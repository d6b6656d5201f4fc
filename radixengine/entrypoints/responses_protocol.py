"""The request of /v1/responses (OpenAI's Responses API) and its translation into the chat request
that serves it: `instructions` and the input items become chat messages (after the conversation
of `previous_response_id`), function tools and `tool_choice` take chat's shapes, `text.format`
becomes `response_format`. What this server cannot honour is a 400 naming the field."""

from __future__ import annotations

from typing import Any

from pydantic import model_validator

from radixengine.entrypoints.openai_protocol import LenientModel
from radixengine.entrypoints.request_fields import UNHONOURED, read_fields
from radixengine.managers.request_errors import RequestError

# SGLang's sampling extras, passed to the chat request as they are (it validates them).
PASSTHROUGH = ("top_k", "min_p", "seed", "stop", "ignore_eos", "priority", "frequency_penalty",
               "presence_penalty", "repetition_penalty", "min_tokens", "stop_token_ids",
               "skip_special_tokens", "chat_template_kwargs", "rid")  # fmt: skip
TEXT_PART_TYPES = ("input_text", "output_text", "text")
TOOL_CHOICES = ("none", "auto", "required")
# Accepted and without effect: no reasoning is encrypted here (the reasoning items carry their
# text), so there is none to include; agents such as Codex ask for it with `store: false`.
ACCEPTED_INCLUDES = ("reasoning.encrypted_content",)


class ResponsesRequest(LenientModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    # Set, these are refused (check_unsupported)
    include: list[str] | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    # SGLang's extras (PASSTHROUGH)
    top_k: Any = None
    min_p: Any = None
    seed: Any = None
    stop: Any = None
    ignore_eos: Any = None
    priority: Any = None
    frequency_penalty: Any = None
    presence_penalty: Any = None
    repetition_penalty: Any = None
    min_tokens: Any = None
    stop_token_ids: Any = None
    skip_special_tokens: Any = None
    chat_template_kwargs: Any = None
    rid: Any = None

    @model_validator(mode="before")
    @classmethod
    def _read_fields(cls, data):
        if not isinstance(data, dict):
            return data
        honoured_here = {"background"}
        return read_fields(data, cls.model_fields, cls.__name__, set(UNHONOURED) - honoured_here)


def check_unsupported(req: ResponsesRequest) -> None:
    """Fields whose set value this server cannot honour: a 400 naming the field."""
    refused = {
        "conversation": "conversations are not supported: continue with previous_response_id",
        "prompt": "prompt templates are not supported",
        "max_tool_calls": "max_tool_calls is not supported",
    }
    for name, why in refused.items():
        if getattr(req, name) not in (None, [], {}):
            raise RequestError(f"{name} is not supported: {why}", param=name)
    for i, name in enumerate(req.include or []):
        if name not in ACCEPTED_INCLUDES:
            raise RequestError(f"include {name!r} is not supported (only {', '.join(ACCEPTED_INCLUDES)})",
                               param=f"include[{i}]")  # fmt: skip
    if req.top_logprobs:
        raise RequestError("top_logprobs is not supported on /v1/responses", param="top_logprobs")
    if req.truncation not in (None, "disabled"):
        raise RequestError(
            f"truncation {req.truncation!r} is not supported (only disabled)", param="truncation"
        )
    if req.background and not req.store:
        raise RequestError("background responses must be stored (store: true)", param="background")
    if req.background and req.stream:
        raise RequestError("background responses cannot stream here; poll GET /v1/responses/{id}",
                           param="stream")  # fmt: skip


# Input items -> chat messages -------------------------------------------------------------------


def input_messages(req: ResponsesRequest) -> list[dict]:
    """The request's own input as chat messages (without instructions)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    if not req.input:
        raise RequestError("input must not be empty", param="input")
    messages: list[dict] = []
    for i, item in enumerate(req.input):
        _add_item(messages, item, f"input[{i}]")
    return messages


def _add_item(messages: list[dict], item: dict, param: str) -> None:
    kind = item.get("type", "message" if "role" in item else None)
    add = _ITEM_ADDERS.get(kind)
    if add is None:
        raise RequestError(
            f"{param}.type {kind!r} is not supported: input items are messages, function_call, "
            "function_call_output and reasoning",
            param=f"{param}.type",
        )
    add(messages, item, param)


def _last_assistant(messages: list[dict]) -> dict | None:
    return messages[-1] if messages and messages[-1]["role"] == "assistant" else None


def _add_message(messages: list[dict], item: dict, param: str) -> None:
    message = _message(item, param)
    last = _last_assistant(messages)
    if (
        message["role"] == "assistant"
        and last is not None
        and not last["content"]
        and not last.get("tool_calls")
    ):
        last["content"] = message["content"]  # the answer after its reasoning item
    else:
        messages.append(message)


def _add_function_call(messages: list[dict], item: dict, param: str) -> None:
    call = {
        "id": _string(item, "call_id", param),
        "type": "function",
        "function": {
            "name": _string(item, "name", param),
            "arguments": _string(item, "arguments", param),
        },
    }
    last = _last_assistant(messages)
    if last is None:
        last = {"role": "assistant", "content": ""}
        messages.append(last)
    last.setdefault("tool_calls", []).append(call)


def _add_function_call_output(messages: list[dict], item: dict, param: str) -> None:
    output = item.get("output")
    content = output if isinstance(output, str) else _parts_text(output, f"{param}.output")
    messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", param), "content": content})


def _add_reasoning(messages: list[dict], item: dict, param: str) -> None:
    texts = [p.get("text", "") for p in item.get("content") or [] if isinstance(p, dict)]
    messages.append({"role": "assistant", "content": "", "reasoning_content": "".join(texts)})


_ITEM_ADDERS = {
    "message": _add_message,
    "function_call": _add_function_call,
    "function_call_output": _add_function_call_output,
    "reasoning": _add_reasoning,
}


def _message(item: dict, param: str) -> dict:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise RequestError(f"{param}.role must be user, system, developer or assistant; got {role!r}",
                           param=f"{param}.role")  # fmt: skip
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(content, f"{param}.content")
    return {"role": role, "content": text}


def _parts_text(parts: object, param: str) -> str:
    if not isinstance(parts, list):
        raise RequestError(f"{param} must be a string or a list of text parts", param=param)
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PART_TYPES or not isinstance(part.get("text"), str):
            raise RequestError(
                f"{param}[{j}] of type {kind!r} is not supported: this server takes text only "
                '({"type": "input_text", "text": ...})',
                param=f"{param}[{j}].type",
            )
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise RequestError(f"{param}.{name} must be a string", param=f"{param}.{name}")
    return value


# Tools and formats ------------------------------------------------------------------------------


def chat_tools(req: ResponsesRequest) -> list[dict] | None:
    """Function tools in chat's shape; any other tool type is a 400 naming it."""
    if req.tools is None:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        kind = tool.get("type")
        if kind != "function":
            raise RequestError(
                f"tools[{i}].type {kind!r} is not supported: this server runs no built-in tools, only "
                'function tools ({"type": "function", "name": ..., "parameters": ...})',
                param=f"tools[{i}].type",
            )
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None
        }
        tools.append({"type": "function", "function": function})
    return tools


def chat_tool_choice(req: ResponsesRequest) -> str | dict | None:
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function":
        raise RequestError(
            f"tool_choice of type {choice.get('type')!r} is not supported: none, auto, required or "
            '{"type": "function", "name": ...}',
            param="tool_choice",
        )
    return {"type": "function", "function": {"name": choice.get("name")}}


def response_format(req: ResponsesRequest) -> dict | None:
    """`text.format` as chat's response_format."""
    fmt = (req.text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise RequestError("text.format must be an object", param="text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise RequestError(f"text.format.type must be text, json_object or json_schema; got {kind!r}",
                       param="text.format.type")  # fmt: skip


def chat_body(req: ResponsesRequest, history: list[dict], messages: list[dict]) -> dict:
    """The chat request that serves `req`: instructions, then the history, then the input."""
    head = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {
        "model": req.model,
        "messages": head + history + messages,
        "stream": req.stream,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": chat_tools(req),
        "tool_choice": chat_tool_choice(req),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": response_format(req),
    }
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    body.update({name: getattr(req, name) for name in PASSTHROUGH})
    return {k: v for k, v in body.items() if v is not None}
