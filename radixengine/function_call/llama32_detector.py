"""Llama 3.x JSON tool calls (SGLang's Llama32Detector, `--tool-call-parser llama3`):

    <|python_tag|>{"name": "f", "parameters": {...}}

the tag optional (the template may leave it out), several calls separated by `;`. A Python
dict (single quotes) is read too."""

from __future__ import annotations

import ast
import json
import re

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
        """Python dict quoting turned into JSON's before reading (as SGLang does)."""
        self._buffer += new_text
        self._buffer = re.sub(r"'([^']*)':", r'"\1":', self._buffer)
        self._buffer = re.sub(r":\s*'([^']*)'", r': "\1"', self._buffer)
        return super().parse_streaming_increment("", tools)

    def structure_info(self) -> GetInfoFunc:
        return lambda name: StructureInfo(
            begin=PYTHON_TAG + '{"name": "' + name + '", "parameters": ', end="}", trigger=PYTHON_TAG
        )


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
