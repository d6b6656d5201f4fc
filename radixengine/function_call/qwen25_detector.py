"""Qwen2.5 / Qwen3 tool calls (SGLang's Qwen25Detector, `--tool-call-parser qwen25` or `qwen`):

    <tool_call>
    {"name": "f", "arguments": {...}}
    </tool_call>

one block per call; the text before the first block is for the user."""

from __future__ import annotations

import json
import logging
import re

from radixengine.function_call.base_format_detector import BaseFormatDetector
from radixengine.function_call.core_types import GetInfoFunc, StreamingParseResult, StructureInfo

logger = logging.getLogger(__name__)


class Qwen25Detector(BaseFormatDetector):
    def __init__(self) -> None:
        super().__init__()
        self.bot_token = "<tool_call>\n"
        self.eot_token = "\n</tool_call>"
        self.tool_call_separator = "\n"
        self._normal_text_buffer = ""  # normal text that may end in a piece of "</tool_call>"

    def has_tool_call(self, text: str) -> bool:
        return self.bot_token in text

    def detect_and_parse(self, text: str, tools: list) -> StreamingParseResult:
        idx = text.find(self.bot_token)
        if idx == -1:
            return StreamingParseResult(normal_text=text)
        pattern = rf"{re.escape(self.bot_token)}(.*?){re.escape(self.eot_token)}"
        calls = []
        for body in re.findall(pattern, text, re.DOTALL):
            try:
                calls.extend(self.parse_base_json(json.loads(body.strip()), tools))
            except json.JSONDecodeError as e:
                logger.warning("cannot parse the tool call %r: %s", body, e)
        return StreamingParseResult(normal_text=text[:idx].strip(), calls=calls)

    def parse_streaming_increment(self, new_text: str, tools: list) -> StreamingParseResult:
        """The base streaming, with a stray "</tool_call>" (split over chunks) kept out of the
        normal text, and the whitespace that ends the normal text held until more text comes:
        before a call it is dropped (the one-go parse strips it)."""
        result = super().parse_streaming_increment(new_text, tools)
        end_tag = self.eot_token[1:]
        pending = (self._normal_text_buffer + result.normal_text).replace(end_tag, "")
        if any(call.name for call in result.calls):  # a call starts: drop the whitespace before it
            result.normal_text, self._normal_text_buffer = pending.rstrip(), ""
            return result
        held = self._ends_with_partial_token(pending, end_tag)
        cut = len(pending[: len(pending) - held].rstrip())
        result.normal_text, self._normal_text_buffer = pending[:cut], pending[cut:]
        return result

    def finish_normal_text(self) -> str:
        held, self._normal_text_buffer = self._normal_text_buffer, ""
        return held + super().finish_normal_text()

    def structure_info(self) -> GetInfoFunc:
        return lambda name: StructureInfo(
            begin='<tool_call>\n{"name": "' + name + '", "arguments": ',
            end="}\n</tool_call>",
            trigger="<tool_call>",
        )
