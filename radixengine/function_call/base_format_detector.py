"""BaseFormatDetector (SGLang's): one model format of tool calls, parsed in one go
(`detect_and_parse`) or as the text streams in (`parse_streaming_increment`).

Streaming follows SGLang's shapes: a call's first piece carries its name (with empty arguments),
the next ones fragments of its arguments' JSON text (`json.dumps` of the arguments, so the
fragments put together equal the one-go answer's `arguments`). A fragment is sent only once two
successive readings of the unfinished JSON agree on it."""

from __future__ import annotations

import json
import logging
import re
from abc import ABC, abstractmethod
from typing import Any

from radixengine.function_call.core_types import GetInfoFunc, StreamingParseResult, ToolCallItem
from radixengine.function_call.partial_json import (
    MalformedJSON,
    find_common_prefix,
    is_complete_json,
    partial_json_loads,
    partial_json_text,
)
from radixengine.utils.unicode_check import dumps_json_text

logger = logging.getLogger(__name__)

_ARGUMENTS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def tool_names(tools: list) -> dict[str, int]:
    """Function name -> its index in `tools` (objects with `.function.name`)."""
    return {tool.function.name: i for i, tool in enumerate(tools) if tool.function.name}


class BaseFormatDetector(ABC):
    def __init__(self) -> None:
        self._buffer = ""  # text held back: an unfinished call or a possible start of one
        self.prev_tool_call_arr: list[dict] = []  # per call: its latest (partial) reading
        self.current_tool_id = -1  # the call being streamed
        self.current_tool_name_sent = False
        self.streamed_args_for_tool: list[str] = []  # per call: the arguments text sent so far
        self._tool_indices: dict[str, int] | None = None
        self.bot_token = ""  # what opens the calls
        self.eot_token = ""  # what closes them
        self.tool_call_separator = ", "
        self._skipped_call = False  # a call of an unknown function was dropped: calls are under way
        self._call_text = ""  # the JSON text of the call read last, as the model wrote it

    # One go ------------------------------------------------------------------------------------

    @abstractmethod
    def has_tool_call(self, text: str) -> bool:
        """Whether `text` holds a call in this format."""

    @abstractmethod
    def detect_and_parse(self, text: str, tools: list) -> StreamingParseResult:
        """The calls in the whole of `text` and the text around them that is for the user."""

    def parse_base_json(self, action: Any, tools: list) -> list[ToolCallItem]:
        """`{"name", "arguments" | "parameters"}` objects (one or a list) -> calls of known
        functions (an unknown name is skipped, as SGLang does by default)."""
        indices = tool_names(tools)
        results = []
        for act in action if isinstance(action, list) else [action]:
            name = act.get("name") if isinstance(act, dict) else None
            if name not in indices:
                logger.warning("the model called an undefined function: %r", name)
                continue
            arguments = act.get("parameters")
            if arguments is None:
                arguments = act.get("arguments", {})
            results.append(
                ToolCallItem(tool_index=indices[name], name=name, parameters=dumps_json_text(arguments))
            )
        return results

    # Streaming ---------------------------------------------------------------------------------

    def _ends_with_partial_token(self, buffer: str, token: str) -> int:
        """Length of the longest end of `buffer` that starts `token` (0: none)."""
        for i in range(min(len(buffer), len(token) - 1), 0, -1):
            if token.startswith(buffer[-i:]):
                return i
        return 0

    def _at_separator(self, text: str) -> bool:
        """After a call: whether `text` starts the next one (whitespace before a separator that
        is not whitespace itself is skipped)."""
        if self.tool_call_separator.strip():
            text = text.lstrip()
        in_calls = self.current_tool_id > 0 or self._skipped_call
        return in_calls and text.startswith(self.tool_call_separator)

    def parse_streaming_increment(self, new_text: str, tools: list) -> StreamingParseResult:
        """SGLang's base streaming: for formats where the bot token is followed by JSON calls
        separated by `tool_call_separator`."""
        self._buffer += new_text
        current_text = self._buffer
        if not (self.has_tool_call(current_text) or self._at_separator(current_text)):
            return self._plain_text()

        if self._tool_indices is None:
            self._tool_indices = tool_names(tools)
        pos = current_text.find(self.bot_token) if self.bot_token else -1
        if self.current_tool_id == -1 and pos > 0:
            # text for the user before the first call, in the same chunk as its start
            self._buffer = current_text[pos:]
            result = BaseFormatDetector.parse_streaming_increment(self, "", tools)
            result.normal_text = current_text[:pos] + result.normal_text
            return result
        return self._stream_current_call(current_text, tools)

    def _plain_text(self) -> StreamingParseResult:
        """No call in the buffer: it is all text for the user, unless its end may start a call."""
        if self._ends_with_partial_token(self._buffer, self.bot_token):
            return StreamingParseResult()  # maybe the start of a call: hold it
        normal_text, self._buffer = self._buffer, ""
        if self.eot_token:
            normal_text = normal_text.replace(self.eot_token, "")
        return StreamingParseResult(normal_text=normal_text)

    def _stream_current_call(self, current_text: str, tools: list) -> StreamingParseResult:
        """The next piece of the call being read: its name once, then its arguments as they come."""
        try:
            read = self._read_current_call(current_text)
        except (MalformedJSON, json.JSONDecodeError):
            return StreamingParseResult()
        if read is None:
            return StreamingParseResult()
        call, start_idx, end_idx = read
        self._call_text = current_text[start_idx : start_idx + end_idx]
        is_complete = is_complete_json(current_text[start_idx : start_idx + end_idx])
        if "name" in call and call["name"] not in self._tool_indices:
            return self._skip_unknown_call(
                call["name"], is_complete, current_text[start_idx + end_idx :], tools
            )
        if "parameters" in call:
            call["arguments"] = call.pop("parameters")
        if not call:
            return StreamingParseResult()
        if not self.current_tool_name_sent:
            return self._stream_name(call)
        return self._stream_arguments(call, is_complete, current_text[start_idx + end_idx :])

    def _skip_unknown_call(
        self, name: str, is_complete: bool, rest: str, tools: list
    ) -> StreamingParseResult:
        """A call of a function not in `tools` is dropped, as the one-go parse drops it, once its
        JSON is whole; the calls after it are read on."""
        if not is_complete:
            return StreamingParseResult()
        logger.warning("the model called an undefined function: %r", name)
        self._buffer, self._skipped_call = "", True
        return BaseFormatDetector.parse_streaming_increment(self, rest, tools)

    def _read_current_call(self, text: str) -> tuple[dict, int, int] | None:
        """The (partial) call object being written: (object, where its JSON starts, its length)."""
        allow_str = self.current_tool_name_sent  # the name only once it is whole
        used_separator = False
        if self._at_separator(text):
            skipped = len(text) - len(text.lstrip()) if self.tool_call_separator.strip() else 0
            start_idx = skipped + len(self.tool_call_separator)
            used_separator = True
        else:
            pos = text.find(self.bot_token)
            start_idx = pos + len(self.bot_token) if pos != -1 else 0
        if start_idx >= len(text):
            return None
        try:
            obj, end_idx = partial_json_loads(text[start_idx:], allow_str)
        except MalformedJSON:
            # the separator was followed by markup (e.g. Qwen's "</tool_call>\n<tool_call>"):
            # the next call starts after the next bot token
            if not used_separator or self.bot_token not in text:
                raise
            start_idx = text.find(self.bot_token) + len(self.bot_token)
            if start_idx >= len(text):
                return None
            obj, end_idx = partial_json_loads(text[start_idx:], allow_str)
        if not isinstance(obj, dict):
            raise MalformedJSON("a call is a JSON object")
        return obj, start_idx, end_idx

    def _stream_name(self, call: dict) -> StreamingParseResult:
        name = call.get("name")
        if not name or name not in self._tool_indices:
            return StreamingParseResult()
        if self.current_tool_id == -1:
            self.current_tool_id = 0
        while len(self.streamed_args_for_tool) <= self.current_tool_id:
            self.streamed_args_for_tool.append("")
        self.current_tool_name_sent = True
        return StreamingParseResult(
            calls=[ToolCallItem(tool_index=self.current_tool_id, name=name, parameters="")]
        )

    def _stream_arguments(self, call: dict, is_complete: bool, rest: str) -> StreamingParseResult:
        arguments = call.get("arguments")
        tool_id = self.current_tool_id
        if arguments is None:
            return StreamingParseResult()
        sent = len(self.streamed_args_for_tool[tool_id])
        cur_json = dumps_json_text(arguments)
        diff = None
        if is_complete:
            diff = cur_json[sent:]
            self._buffer = rest
        elif tool_id < len(self.prev_tool_call_arr):
            prev = self.prev_tool_call_arr[tool_id].get("arguments")
            if prev is not None:
                prev_json = dumps_json_text(prev)
                if prev_json != cur_json:
                    diff = find_common_prefix(prev_json, cur_json)[sent:]
        while len(self.prev_tool_call_arr) <= tool_id:
            self.prev_tool_call_arr.append({})
        self.prev_tool_call_arr[tool_id] = call
        if is_complete:
            self.current_tool_name_sent = False
            self.current_tool_id += 1
        if not diff:
            return StreamingParseResult()
        self.streamed_args_for_tool[tool_id] += diff
        return StreamingParseResult(calls=[ToolCallItem(tool_index=tool_id, parameters=diff)])

    def finish_normal_text(self) -> str:
        """At the end of the stream: the text held back as a possible start of a call that
        turned out to be none (what the one-go parse gives the user)."""
        if self.current_tool_id != -1 or self.current_tool_name_sent or self.has_tool_call(self._buffer):
            return ""
        text, self._buffer = self._buffer, ""
        return text.replace(self.eot_token, "") if self.eot_token else text

    def unstreamed_arguments(self) -> tuple[int, str] | None:
        """At the end of the stream: the last call's arguments not sent yet (SGLang's
        `_check_for_unstreamed_tool_args`), as (call index, text). A call cut short (max_tokens)
        keeps its arguments' text as far as it goes, unclosed (as OpenAI's), never a closed
        reading of it that would pass for whole arguments."""
        if self.current_tool_name_sent:
            return self._cut_call_arguments()
        if not self.prev_tool_call_arr or not self.streamed_args_for_tool:
            return None
        tool_id = len(self.prev_tool_call_arr) - 1
        if tool_id >= len(self.streamed_args_for_tool):
            return None
        expected = self.prev_tool_call_arr[tool_id].get("arguments", {})
        expected_json = expected if isinstance(expected, str) else dumps_json_text(expected)
        actual = self.streamed_args_for_tool[tool_id]
        if not expected_json.startswith(actual) or expected_json == actual:
            return None
        self.streamed_args_for_tool[tool_id] = expected_json
        return tool_id, expected_json[len(actual) :]

    def _cut_call_arguments(self) -> tuple[int, str] | None:
        tool_id = self.current_tool_id
        if tool_id < 0 or tool_id >= len(self.streamed_args_for_tool):
            return None
        key = _ARGUMENTS_KEY.search(self._call_text)
        partial = partial_json_text(self._call_text[key.end() :]) if key else ""
        sent = self.streamed_args_for_tool[tool_id]
        if not partial.startswith(sent) or partial == sent:
            return None
        self.streamed_args_for_tool[tool_id] = partial
        return tool_id, partial[len(sent) :]

    # Grammars ----------------------------------------------------------------------------------

    def supports_structural_tag(self) -> bool:
        return True

    @abstractmethod
    def structure_info(self) -> GetInfoFunc:
        """name -> how a call of that function is written (for the structural-tag grammar)."""
