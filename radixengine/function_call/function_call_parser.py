"""FunctionCallParser (SGLang's): the `--tool-call-parser` detectors by SGLang's names, and the
one-go and streaming parse of a choice's text into calls."""

from __future__ import annotations

from radixengine.function_call.base_format_detector import BaseFormatDetector
from radixengine.function_call.core_types import ToolCallItem
from radixengine.function_call.json_array_parser import JsonArrayParser
from radixengine.function_call.llama32_detector import Llama32Detector
from radixengine.function_call.pythonic_detector import PythonicDetector
from radixengine.function_call.qwen25_detector import Qwen25Detector

TOOL_CALL_PARSERS: dict[str, type[BaseFormatDetector]] = {
    "llama3": Llama32Detector,
    "qwen": Qwen25Detector,
    "qwen25": Qwen25Detector,
    "pythonic": PythonicDetector,
}


class FunctionCallParser:
    """Parses one choice's text with the detector of `tool_call_parser`, or with the JSON-array
    parser (`None`: the output is the JSON array a grammar forced)."""

    def __init__(self, tools: list, tool_call_parser: str | None) -> None:
        if tool_call_parser is None:
            self.detector: BaseFormatDetector = JsonArrayParser()
        elif tool_call_parser in TOOL_CALL_PARSERS:
            self.detector = TOOL_CALL_PARSERS[tool_call_parser]()
        else:
            raise ValueError(f"unknown tool call parser {tool_call_parser!r}")
        self.tools = tools

    def has_tool_call(self, text: str) -> bool:
        return bool(self.tools) and self.detector.has_tool_call(text)

    def parse_non_stream(self, full_text: str) -> tuple[str, list[ToolCallItem]]:
        """(the text for the user, the calls)."""
        if not self.tools:
            return full_text, []
        has_call = self.detector.has_tool_call(full_text)
        result = self.detector.detect_and_parse(full_text, self.tools)
        if result.calls or has_call:
            return result.normal_text, result.calls
        return full_text, []

    def parse_as_stream(self, full_text: str) -> tuple[str, list[ToolCallItem]]:
        """A whole answer read the way a stream of it is read (one chunk, then the end), so the
        answer says what its stream says, a call cut short by max_tokens included: (the text for
        the user, one item a call: its name and its arguments put together)."""
        normal, items = self.parse_stream_chunk(full_text)
        end_normal, end_items = self.parse_stream_end()
        calls: dict[int, ToolCallItem] = {}
        for item in items + end_items:
            if item.name:
                calls[item.tool_index] = ToolCallItem(
                    tool_index=item.tool_index, name=item.name, parameters=""
                )
            calls[item.tool_index].parameters += item.parameters
        return normal + end_normal, [calls[i] for i in sorted(calls)]

    def parse_stream_chunk(self, chunk_text: str) -> tuple[str, list[ToolCallItem]]:
        """(new text for the user, new call pieces) of the next chunk of the stream."""
        if not self.tools:
            return chunk_text, []
        normal_text, calls = "", []
        result = self.detector.parse_streaming_increment(chunk_text, self.tools)
        # a chunk of several tokens may hold a call's name and arguments, or several calls: read
        # on until the detector has nothing more to send (SGLang's detectors take one step a call)
        while True:
            normal_text += result.normal_text
            calls += result.calls
            if not result.calls:
                return normal_text, calls
            result = self.detector.parse_streaming_increment("", self.tools)

    def parse_stream_end(self) -> tuple[str, list[ToolCallItem]]:
        """(text held back for the user, the last call's arguments not sent yet) at the end."""
        normal_text = self.detector.finish_normal_text() if self.tools else ""
        rest = self.detector.unstreamed_arguments() if self.tools else None
        calls = [ToolCallItem(tool_index=rest[0], parameters=rest[1])] if rest else []
        return normal_text, calls
