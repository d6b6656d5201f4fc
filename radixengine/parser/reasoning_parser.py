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
        self.stripped_think_start = False
        # continue_final_message: the assistant text so far may have opened (or closed) the block
        self.previous_content = previous_content if continue_final_message else ""
        if self.think_start_token in self.previous_content:
            self._in_reasoning = True
        if self.think_end_token in self.previous_content:
            self._in_reasoning = False

    def detect_and_parse(self, text: str) -> StreamingParseResult:
        in_reasoning = self._in_reasoning or self.think_start_token in text
        if not in_reasoning:
            return StreamingParseResult(normal_text=text)
        processed = text
        while processed.startswith(self.think_start_token):
            processed = processed[len(self.think_start_token) :]
        if self.think_end_token in processed:
            reasoning, normal = processed.split(self.think_end_token, maxsplit=1)
            return StreamingParseResult(normal_text=normal, reasoning_text=reasoning)
        if self.think_end_token in self.previous_content:
            return StreamingParseResult(normal_text=processed)
        if self.tool_start_token is not None and self.tool_start_token in processed:
            idx = processed.find(self.tool_start_token)
            return StreamingParseResult(normal_text=processed[idx:], reasoning_text=processed[:idx])
        return StreamingParseResult(reasoning_text=processed)  # cut short before `</think>`

    def parse_streaming_increment(self, new_text: str) -> StreamingParseResult:
        """The next chunk's reasoning and answer. A chunk that ends in what may be the start of
        a marker (`</thi`) holds that end back until the next chunk tells. With
        `stream_reasoning` off, the reasoning comes in one piece when its block ends."""
        self._buffer += new_text
        current = self._buffer
        if not self.stripped_think_start and self.think_start_token in current:
            current = current.replace(self.think_start_token, "", 1)
            self.stripped_think_start = True
            self._in_reasoning = True
            self._buffer = current
        if self._in_reasoning and self.think_end_token in current:
            end = current.find(self.think_end_token)
            self._buffer = ""
            self._in_reasoning = False
            return StreamingParseResult(
                normal_text=current[end + len(self.think_end_token) :], reasoning_text=current[:end]
            )
        if self._in_reasoning:
            if self.tool_start_token and self.tool_start_token in current:
                idx = current.find(self.tool_start_token)
                self._buffer = ""
                self._in_reasoning = False
                return StreamingParseResult(normal_text=current[idx:], reasoning_text=current[:idx])
            if not self.stream_reasoning:
                return StreamingParseResult()
            markers = [self.think_end_token, self.tool_start_token]
            if not self.stripped_think_start:
                markers.append(self.think_start_token)
            held = self._held(current, markers)
            self._buffer = current[len(current) - held :]
            return StreamingParseResult(reasoning_text=current[: len(current) - held])
        held = 0 if self.stripped_think_start else self._held(current, [self.think_start_token])
        self._buffer = current[len(current) - held :]
        return StreamingParseResult(normal_text=current[: len(current) - held])

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
        if not held:
            return StreamingParseResult()
        if not self.stripped_think_start and held.startswith(self.think_start_token):
            held = held[len(self.think_start_token) :]
            self._in_reasoning = True
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
