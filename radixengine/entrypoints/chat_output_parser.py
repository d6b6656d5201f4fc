"""A chat choice's text split the way SGLang's serving_chat splits it: the reasoning
(`--reasoning-parser`, with `separate_reasoning`) into `reasoning_content`, then the tool calls
into OpenAI `tool_calls` — in one go for a whole answer, or chunk by chunk for a stream, where a
call's first delta carries its id and name and the next ones fragments of its arguments."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from radixengine.entrypoints.chat_tools import forced_call_parser, is_forced, tools_active
from radixengine.entrypoints.openai_protocol import ChatCompletionRequest
from radixengine.function_call.core_types import ToolCallItem
from radixengine.function_call.function_call_parser import FunctionCallParser
from radixengine.parser.reasoning_parser import ReasoningParser

_NO_PARSE = object()


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedChoice:
    content: str
    reasoning_content: str | None = None
    tool_calls: list[dict] = field(default_factory=list)


class ChatOutputParser:
    """The parsing a request's choices get; `new_stream()` gives one choice's streaming state."""

    def __init__(self, req: ChatCompletionRequest, server_args) -> None:
        self.req = req
        self.reasoning_parser = server_args.reasoning_parser if req.separate_reasoning else None
        self.tool_parser_name = _tool_parser_name(req, server_args)

    @property
    def active(self) -> bool:
        return self.reasoning_parser is not None or self.tool_parser_name is not _NO_PARSE

    @property
    def reports_reasoning(self) -> bool:
        return self.reasoning_parser is not None

    def _reasoning(self, stream: bool) -> ReasoningParser | None:
        if self.reasoning_parser is None:
            return None
        req = self.req
        previous = ""
        if req.continue_final_message and req.messages and isinstance(req.messages[-1].content, str):
            previous = req.messages[-1].content
        return ReasoningParser(
            self.reasoning_parser,
            stream_reasoning=req.stream_reasoning if stream else False,
            force_reasoning=(req.chat_template_kwargs or {}).get("enable_thinking") is not False,
            continue_final_message=req.continue_final_message,
            previous_content=previous,
        )

    def _tools(self) -> FunctionCallParser | None:
        if self.tool_parser_name is _NO_PARSE:
            return None
        return FunctionCallParser(self.req.tools, self.tool_parser_name)

    def parse(self, text: str) -> ParsedChoice:
        """A whole answer."""
        reasoning = None
        parser = self._reasoning(stream=False)
        if parser is not None:
            reasoning, text = parser.parse_non_stream(text)
        tools = self._tools()
        calls: list[ToolCallItem] = []
        if tools is not None:
            text, calls = tools.parse_as_stream(text)
        tool_calls = [_tool_call(i, c.name, c.parameters) for i, c in enumerate(calls)]
        return ParsedChoice(content=text, reasoning_content=reasoning or None, tool_calls=tool_calls)

    def new_stream(self) -> StreamParser:
        return StreamParser(self._reasoning(stream=True), self._tools())


class StreamParser:
    """One streamed choice: each chunk of text -> the deltas to send."""

    def __init__(self, reasoning: ReasoningParser | None, tools: FunctionCallParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.has_tool_calls = False
        self._ids: dict[int, str] = {}

    def step(self, text: str, finished: bool) -> list[dict]:
        deltas: list[dict] = []
        if self.reasoning is not None:
            reasoning, text = self.reasoning.parse_stream_chunk(text)
            if finished:
                end_reasoning, end_text = self.reasoning.parse_stream_end()
                reasoning, text = reasoning + end_reasoning, text + end_text
            if reasoning:
                deltas.append({"reasoning_content": reasoning})
        if self.tools is None:
            if text:
                deltas.append({"content": text})
            return deltas
        normal, calls = self.tools.parse_stream_chunk(text)
        if finished:
            end_normal, end_calls = self.tools.parse_stream_end()
            normal, calls = normal + end_normal, calls + end_calls
        if normal:
            deltas.append({"content": normal})
        for call in calls:
            deltas.append({"tool_calls": [self._tool_call_delta(call)]})
        return deltas

    def _tool_call_delta(self, call: ToolCallItem) -> dict:
        self.has_tool_calls = True
        if call.name:
            self._ids[call.tool_index] = tool_call_id()
            return _tool_call(call.tool_index, call.name, call.parameters, self._ids[call.tool_index])
        return {"index": call.tool_index, "function": {"arguments": call.parameters}}


def _tool_call(index: int, name: str, arguments: str, call_id: str | None = None) -> dict:
    return {
        "index": index,
        "id": call_id or tool_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _tool_parser_name(req: ChatCompletionRequest, server_args):
    """Which parser reads the calls: for a forced call, the one whose format the grammar forced
    (`None`: the JSON array); for `auto`, the server's `--tool-call-parser` (none: the text is
    left as it is, as in SGLang)."""
    if not tools_active(req):
        return _NO_PARSE
    if is_forced(req):
        return forced_call_parser(server_args)
    return server_args.tool_call_parser or _NO_PARSE
