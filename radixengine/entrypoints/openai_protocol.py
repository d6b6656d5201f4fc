"""Pydantic models of the OpenAI-compatible API and the response builders' shapes. A request is
read the way SGLang reads it (`request_fields.read_fields`: nulls are unset, unknown fields are
ignored), then validated strictly: a wrong type or value is an error naming the field."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from radixengine.entrypoints.request_fields import read_fields

_STRICT = ConfigDict(strict=True, extra="forbid")


class LenientModel(BaseModel):
    """Strict types; `null` is the field's default, an unknown field is ignored (logged once)."""

    model_config = _STRICT

    @model_validator(mode="before")
    @classmethod
    def _read_fields(cls, data):
        if not isinstance(data, dict):
            return data
        return read_fields(data, cls.model_fields, cls.__name__)


class ErrorResponse(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class StreamOptions(LenientModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(LenientModel):
    """Fields shared by both endpoints, OpenAI's and SGLang's extra ones (extra_body). `model`
    may name anything: this server has one model (SGLang's rule). The fields the model's
    generation_config.json may give a default for (chat) are tracked through `model_fields_set`."""

    model: str | None = None  # the model, a LoRA adapter's name, or SGLang's "base:adapter"
    lora_path: str | None = None  # SGLang's extra: a LoRA adapter's name (wins over `model`)
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    sampling_seed: int | None = None  # SGLang's name for seed (seed wins when both are given)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # SGLang's extras
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    min_tokens: int = 0
    priority: int | None = None
    rid: str | None = None
    return_hidden_states: bool = False  # refused when true (request_fields.UNHONOURED)
    # Constrained decoding (see openai_serving.constraint_params); SGLang's extras as strings
    response_format: dict[str, Any] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


_NESTED = ConfigDict(strict=True, extra="ignore")


class FunctionCall(BaseModel):
    """A call in an assistant message of the conversation: `arguments` is JSON text (OpenAI's)
    or an object."""

    model_config = _NESTED
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    model_config = _NESTED
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's reasoning (for templates that show it)


class FunctionDefinition(BaseModel):
    model_config = _NESTED
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _NESTED
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    model_config = _NESTED
    name: str


class ToolChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}`: call this function."""

    model_config = _NESTED
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | str | None = None  # none, auto (the default with tools), required
    parallel_tool_calls: bool = True
    # SGLang's extras
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True  # with --reasoning-parser: reasoning_content apart from content
    stream_reasoning: bool = True  # stream the reasoning as it comes (else in one piece at its end)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


def make_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "radixengine"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)
