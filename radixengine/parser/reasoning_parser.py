"""ReasoningParser (SGLang's, `--reasoning-parser`): a reasoning model's `<think>...</think>`
block split from its answer, in one go or as the text streams in.

`force_reasoning`: the text starts inside the block (DeepSeek-R1 writes no `<think>`; Qwen3's
template may open it in the prompt), so everything up to `</think>` is reasoning, all of it when
there is no `</think>`. Otherwise the text is reasoning only from a `<think>` on."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StreamingParseResult:
    normal_text: str = ""
    reasoning_text: str = ""


class BaseReasoningFormatDetector:
    """A `<think>` opens the block only as the first thing of the output (a later one, in the
    answer or after `</think>`, is the model's text), and the block ends at the first
    `</think>`, or at a call's start marker where the format has one; the one-go and the
    streaming parse follow the same rule, so a stream says what the whole answer says."""

    def __init__(
        self,
        think_start_token: str,
        think_end_token: str,
        force_reasoning: bool = False,
        stream_reasoning: bool = True,
        tool_start_token: str | None = None,
        continue_final_message: bool = False,
        previous_content: str = "",
    ) -> None:
        self.think_start_token = think_start_token
        self.think_end_token = think_end_token
        self.tool_start_token = tool_start_token  # a call that opens ends the reasoning too
        self._in_reasoning = force_reasoning
        self.stream_reasoning = stream_reasoning
        self._buffer = ""
        # continue_final_message: the assistant text so far may have opened (or closed) the block
        self.previous_content = previous_content if continue_final_message else ""
        self._start_decided = bool(self.previous_content)  # whether the output may still open it
        if self.think_start_token in self.previous_content:
            self._in_reasoning = True
        if self.think_end_token in self.previous_content:
            self._in_reasoning = False

    def _block_end(self, text: str) -> tuple[int, int]:
        """(where the reasoning in `text` ends, where the answer starts), or (-1, -1)."""
        end = text.find(self.think_end_token)
        tool = text.find(self.tool_start_token) if self.tool_start_token else -1
        if tool != -1 and (end == -1 or tool < end):
            return tool, tool
        return (end, end + len(self.think_end_token)) if end != -1 else (-1, -1)

    def detect_and_parse(self, text: str) -> StreamingParseResult:
        in_reasoning = self._in_reasoning
        if not self._start_decided and text.startswith(self.think_start_token):
            text, in_reasoning = text[len(self.think_start_token) :], True
        if not in_reasoning:
            return StreamingParseResult(normal_text=text)
        end, answer = self._block_end(text)
        if end == -1:
            return StreamingParseResult(reasoning_text=text)  # cut short before `</think>`
        return StreamingParseResult(normal_text=text[answer:], reasoning_text=text[:end])

    def parse_streaming_increment(self, new_text: str) -> StreamingParseResult:
        """The next chunk's reasoning and answer. A chunk that ends in what may be the start of
        a marker (`</thi`) holds that end back until the next chunk tells. With
        `stream_reasoning` off, the reasoning comes in one piece when its block ends."""
        self._buffer += new_text
        if not self._start_decided:
            if len(self._buffer) < len(self.think_start_token) and self.think_start_token.startswith(
                self._buffer
            ):
                return StreamingParseResult()  # maybe the start of `<think>`
            self._start_decided = True
            if self._buffer.startswith(self.think_start_token):
                self._buffer, self._in_reasoning = self._buffer[len(self.think_start_token) :], True
        current = self._buffer
        if not self._in_reasoning:
            self._buffer = ""
            return StreamingParseResult(normal_text=current)
        end, answer = self._block_end(current)
        if end != -1:
            self._buffer, self._in_reasoning = "", False
            return StreamingParseResult(normal_text=current[answer:], reasoning_text=current[:end])
        if not self.stream_reasoning:
            return StreamingParseResult()
        held = self._held(current, [self.think_end_token, self.tool_start_token])
        self._buffer = current[len(current) - held :]
        return StreamingParseResult(reasoning_text=current[: len(current) - held])

    @staticmethod
    def _held(text: str, markers: list[str | None]) -> int:
        """Length of the longest end of `text` that is a proper start of one of `markers`."""
        best = 0
        for marker in markers:
            for n in range(min(len(text), len(marker or "") - 1), best, -1):
                if marker.startswith(text[-n:]):
                    best = n
                    break
        return best

    def finish(self) -> StreamingParseResult:
        """At the end of the stream: what is still held. SGLang drops it; here the reasoning
        held back (stream_reasoning off, no `</think>`) or a text that only looked like the start
        of a marker comes out, so the stream says what the one-go answer says."""
        held, self._buffer = self._buffer, ""
        self._start_decided = True
        if not held:
            return StreamingParseResult()
        if self._in_reasoning:
            return StreamingParseResult(reasoning_text=held)
        return StreamingParseResult(normal_text=held)


class DeepSeekR1Detector(BaseReasoningFormatDetector):
    """DeepSeek-R1: reasoning from the start (with or without `<think>`) up to `</think>`."""

    def __init__(self, stream_reasoning: bool = True, force_reasoning: bool = True, **kwargs) -> None:
        super().__init__(
            "<think>", "</think>", force_reasoning=True, stream_reasoning=stream_reasoning, **kwargs
        )


class Qwen3Detector(BaseReasoningFormatDetector):
    """Qwen3: `<think>reasoning</think>answer` when thinking is on; a `<tool_call>` inside the
    block ends it."""

    def __init__(self, stream_reasoning: bool = True, force_reasoning: bool = False, **kwargs) -> None:
        super().__init__(
            "<think>",
            "</think>",
            force_reasoning=force_reasoning,
            stream_reasoning=stream_reasoning,
            tool_start_token="<tool_call>",
            **kwargs,
        )


REASONING_PARSERS: dict[str, type[BaseReasoningFormatDetector]] = {
    "deepseek-r1": DeepSeekR1Detector,
    "qwen3": Qwen3Detector,
    "qwen3-thinking": Qwen3Detector,
}
# Parsers whose model always thinks: the text is reasoning until `</think>` whatever the request.
ALWAYS_THINKING = {"deepseek-r1", "qwen3-thinking"}


class ReasoningParser:
    def __init__(
        self,
        model_type: str,
        stream_reasoning: bool = True,
        force_reasoning: bool = False,
        continue_final_message: bool = False,
        previous_content: str = "",
    ) -> None:
        detector_class = REASONING_PARSERS.get(model_type.lower())
        if detector_class is None:
            raise ValueError(f"unknown reasoning parser {model_type!r}")
        self.detector = detector_class(
            stream_reasoning=stream_reasoning,
            force_reasoning=force_reasoning or model_type.lower() in ALWAYS_THINKING,
            continue_final_message=continue_final_message,
            previous_content=previous_content,
        )

    def parse_non_stream(self, full_text: str) -> tuple[str, str]:
        """(reasoning, answer)."""
        ret = self.detector.detect_and_parse(full_text)
        return ret.reasoning_text, ret.normal_text

    def parse_stream_chunk(self, chunk_text: str) -> tuple[str, str]:
        ret = self.detector.parse_streaming_increment(chunk_text)
        return ret.reasoning_text, ret.normal_text

    def parse_stream_end(self) -> tuple[str, str]:
        ret = self.detector.finish()
        return ret.reasoning_text, ret.normal_text
