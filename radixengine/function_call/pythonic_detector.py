"""Pythonic tool calls (SGLang's PythonicDetector, `--tool-call-parser pythonic`; Llama 4 and
others): a Python list of calls with literal keyword arguments,

    [get_weather(city="Paris"), get_time(zone="CET")]

optionally inside <|python_start|> ... <|python_end|>. Streaming holds the text from `[` until
its `]` and then parses the list whole."""

from __future__ import annotations

import ast
import logging
import re

from radixengine.function_call.base_format_detector import BaseFormatDetector, tool_names
from radixengine.function_call.core_types import GetInfoFunc, StreamingParseResult, ToolCallItem
from radixengine.utils.unicode_check import dumps_json_text

logger = logging.getLogger(__name__)

_MARKERS = ("<|python_start|>", "<|python_end|>")
_CALLS = re.compile(
    r"\[([a-zA-Z]+\w*\(([a-zA-Z]+\w*=.*,\s*)*([a-zA-Z]+\w*=.*\s)?\),\s*)*"
    r"([a-zA-Z]+\w*\(([a-zA-Z]+\w*=.*,\s*)*([a-zA-Z]+\w*=.*\s*)?\)\s*)+\]",
    re.DOTALL,
)


def _strip_markers(text: str) -> str:
    for marker in _MARKERS:
        text = text.replace(marker, "")
    return text


class PythonicDetector(BaseFormatDetector):
    def __init__(self) -> None:
        super().__init__()
        self._calls_sent = 0  # calls of the lists streamed so far

    def has_tool_call(self, text: str) -> bool:
        return bool(_CALLS.search(_strip_markers(text.strip())))

    def detect_and_parse(self, text: str, tools: list) -> StreamingParseResult:
        text = _strip_markers(text.strip())
        match = _CALLS.search(text)
        if match is None:
            return StreamingParseResult(normal_text=text)
        normal_text = text[: match.start()] + text[match.end() :]
        try:
            parsed = getattr(ast.parse(match.group(0)).body[0], "value", None)
        except SyntaxError:
            return StreamingParseResult(normal_text=normal_text)
        if not (isinstance(parsed, ast.List) and all(isinstance(e, ast.Call) for e in parsed.elts)):
            return StreamingParseResult(normal_text=normal_text)
        known = tool_names(tools)
        calls = []
        for call in parsed.elts:
            if not isinstance(call.func, ast.Name):
                continue
            if call.func.id not in known:
                logger.warning("the model called an undefined function: %r", call.func.id)
                continue
            try:
                arguments = {kw.arg: _literal(kw.value) for kw in call.keywords}
            except ValueError as e:
                logger.warning("cannot read the call of %s: %s", call.func.id, e)
                continue
            calls.append(
                ToolCallItem(
                    tool_index=len(calls),
                    name=call.func.id,
                    parameters=dumps_json_text(arguments),
                )
            )
        return StreamingParseResult(normal_text=normal_text, calls=calls)

    def parse_streaming_increment(self, new_text: str, tools: list) -> StreamingParseResult:
        self._buffer += new_text
        held = ""
        for marker in _MARKERS:
            n = self._ends_with_partial_token(self._buffer, marker)
            if n:
                held = self._buffer[-n:]
                break
        text = _strip_markers(self._buffer[: len(self._buffer) - len(held)])
        start = text.find("[")
        if start == -1:
            self._buffer = held
            return StreamingParseResult(normal_text=text)
        end = _matching_bracket(text, start)
        if end == -1:
            self._buffer = text[start:] + held
            return StreamingParseResult(normal_text=text[:start])
        result = self.detect_and_parse(text[start : end + 1], tools)
        for call in result.calls:  # a later list's calls follow the earlier ones
            call.tool_index += self._calls_sent
        self._calls_sent += len(result.calls)
        self._buffer = text[end + 1 :] + held
        result.normal_text = text[:start] + result.normal_text
        return result

    def supports_structural_tag(self) -> bool:
        return False

    def structure_info(self) -> GetInfoFunc:
        raise NotImplementedError("pythonic calls have no structural tag")


def _matching_bracket(text: str, start: int) -> int:
    """Where the `[` at `start` closes, brackets inside Python string literals not counted; -1
    while it is open."""
    depth, quote, i = 0, "", start
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1  # the escaped character
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in "[]":
            depth += 1 if c == "[" else -1
            if depth == 0:
                return i
        i += 1
    return -1


def _literal(node: ast.AST):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.List):
        return [_literal(v) for v in node.elts]
    raise ValueError("tool call arguments must be literals")
