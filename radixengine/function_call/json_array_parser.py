"""The calls a JSON-schema grammar forced (`tool_choice` required or a named function, when the
parser has no structural tag or there is no `--tool-call-parser`): a JSON array of
`{"name": ..., "parameters": {...}}` (SGLang's JsonArrayParser). The output is all calls: no
text for the user."""

from __future__ import annotations

import json

from radixengine.function_call.base_format_detector import BaseFormatDetector
from radixengine.function_call.core_types import GetInfoFunc, StreamingParseResult


class JsonArrayParser(BaseFormatDetector):
    def __init__(self) -> None:
        super().__init__()
        self.bot_token = "["
        self.eot_token = "]"
        self.tool_call_separator = ","

    def has_tool_call(self, text: str) -> bool:
        return "[" in text or "{" in text

    def detect_and_parse(self, text: str, tools: list) -> StreamingParseResult:
        try:
            action = json.loads(text)
        except json.JSONDecodeError:
            return StreamingParseResult(normal_text=text)
        return StreamingParseResult(calls=self.parse_base_json(action, tools))

    def parse_streaming_increment(self, new_text: str, tools: list) -> StreamingParseResult:
        result = super().parse_streaming_increment(new_text, tools)
        result.normal_text = ""  # the array's brackets, commas and whitespace
        return result

    def supports_structural_tag(self) -> bool:
        return False

    def structure_info(self) -> GetInfoFunc:
        raise NotImplementedError("a JSON array of calls is forced with a JSON schema")
