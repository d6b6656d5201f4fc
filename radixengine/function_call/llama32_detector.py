"""Llama 3.x JSON tool calls (SGLang's Llama32Detector, `--tool-call-parser llama3`):

    <|python_tag|>{"name": "f", "parameters": {...}}

the tag optional (the template may leave it out), several calls separated by `;`. A Python
dict (single quotes) is read too."""

from __future__ import annotations

import ast
import json

from radixengine.function_call.base_format_detector import BaseFormatDetector
from radixengine.function_call.core_types import GetInfoFunc, StreamingParseResult, StructureInfo

PYTHON_TAG = "<|python_tag|>"


class Llama32Detector(BaseFormatDetector):
    def __init__(self) -> None:
        super().__init__()
        self.bot_token = PYTHON_TAG
        self.tool_call_separator = ";"

    def has_tool_call(self, text: str) -> bool:
        return PYTHON_TAG in text or text.startswith("{")

    def detect_and_parse(self, text: str, tools: list) -> StreamingParseResult:
        if not self.has_tool_call(text):
            return StreamingParseResult(normal_text=text)
        if PYTHON_TAG in text:
            normal_text, action_text = text.split(PYTHON_TAG, maxsplit=1)
        else:
            normal_text, action_text = "", text
        decoder = json.JSONDecoder()
        actions, idx, safe_idx = [], 0, 0
        while idx < len(action_text):
            start = len(action_text) - len(action_text[idx:].lstrip())
            try:
                obj, end = decoder.raw_decode(action_text, start)
                actions.append(obj)
                idx = safe_idx = end + len(self.tool_call_separator)
                continue
            except json.JSONDecodeError:
                pass
            dict_end = _python_dict_end(action_text, start)
            parsed = _python_dict(action_text[start:dict_end]) if dict_end else None
            if parsed is not None:
                actions.append(parsed)
                idx = safe_idx = dict_end + len(self.tool_call_separator)
                continue
            idx = action_text.find('{"name":', idx + 1)
            if idx == -1:
                break
        calls = self.parse_base_json(actions, tools) if actions else []
        trailing = action_text[safe_idx:].strip() if safe_idx < len(action_text) else ""
        return StreamingParseResult(normal_text=normal_text + trailing, calls=calls)

    def parse_streaming_increment(self, new_text: str, tools: list) -> StreamingParseResult:
        """A Python dict's single-quoted strings turned into JSON strings before reading (SGLang
        rewrites quotes with regexes over all the text, changing JSON string values and the text
        for the user); only the calls' text is touched."""
        self._buffer += new_text
        start = self._buffer.find(PYTHON_TAG)
        if start != -1:
            start += len(PYTHON_TAG)
        elif self._buffer.startswith("{") or self.current_tool_id > 0 or self._skipped_call:
            start = 0
        if start != -1:
            self._buffer = self._buffer[:start] + python_quotes_to_json(self._buffer[start:])
        return super().parse_streaming_increment("", tools)

    def structure_info(self) -> GetInfoFunc:
        return lambda name: StructureInfo(
            begin=PYTHON_TAG + '{"name": "' + name + '", "parameters": ', end="}", trigger=PYTHON_TAG
        )


def python_quotes_to_json(text: str) -> str:
    """`text` with each whole single-quoted string outside double-quoted ones written as a JSON
    string; from an unfinished string on, the text is left as it is (more of it may come)."""
    out, i = [], 0
    while i < len(text):
        quote = text[i]
        if quote not in "'\"":
            out.append(quote)
            i += 1
            continue
        end = _string_end(text, i)
        if end == -1:
            out.append(text[i:])
            break
        out.append(text[i:end] if quote == '"' else _as_json_string(text[i + 1 : end - 1]))
        i = end
    return "".join(out)


def _string_end(text: str, start: int) -> int:
    """Just past the quote that closes the string opened at `start` (-1: not closed yet)."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == text[start]:
            return i + 1
        else:
            i += 1
    return -1


def _as_json_string(body: str) -> str:
    """A single-quoted Python string's body as a JSON string: `\\'` unescaped, `"` escaped."""
    out, i = ['"'], 0
    while i < len(body):
        if body[i] == "\\" and i + 1 < len(body):
            out.append("'" if body[i + 1] == "'" else body[i : i + 2])
            i += 2
            continue
        out.append('\\"' if body[i] == '"' else body[i])
        i += 1
    out.append('"')
    return "".join(out)


def _python_dict_end(text: str, start: int) -> int:
    """End of the brace-balanced `{...}` at `start` (0: none)."""
    if not text.startswith("{", start):
        return 0
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return 0


def _python_dict(text: str) -> dict | None:
    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, dict) else None
