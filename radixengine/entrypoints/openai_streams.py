"""The stream chunks of /v1/completions and /v1/chat/completions (`stream: true`), built from the
engine's outputs as they come, choice by choice."""

from __future__ import annotations

from collections.abc import AsyncIterator

from radixengine.entrypoints.chat_output_parser import StreamParser
from radixengine.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest, make_id, now
from radixengine.entrypoints.openai_serving import (
    chat_logprobs,
    completion_logprobs,
    echo_text,
    finish_reason_of,
    logprobs_of,
    output_parser,
    usage_of,
)
from radixengine.managers.request_errors import abort_to_error, is_abort
from radixengine.managers.tokenizer_manager import TokenizerManager


class _Deltas:
    """Per choice: how much text and how many ids were already sent."""

    def __init__(self) -> None:
        self.text_len: dict[int, int] = {}
        self.ids_len: dict[int, int] = {}

    def take(self, i: int, out: dict) -> tuple[str, list[int], tuple[list, list]]:
        """The choice's new text, ids, and its new tokens' logprobs and top logprobs."""
        t0, k0 = self.text_len.get(i, 0), self.ids_len.get(i, 0)
        text, ids = out["text"], out["output_ids"]
        self.text_len[i], self.ids_len[i] = max(t0, len(text)), len(ids)
        tokens, tops = logprobs_of(out, "output")
        return text[t0:], ids[k0:], (tokens[k0 : len(ids)], tops[k0 : len(ids)])


class _Stream:
    """What both streams keep: the id and time of every chunk, what was sent, the finished
    choices' last outputs (for the usage chunk)."""

    def __init__(self, req: CompletionRequest | ChatCompletionRequest, prefix: str, obj: str) -> None:
        self.req, self.obj = req, obj
        self.rid, self.created, self.deltas = make_id(prefix), now(), _Deltas()
        self.finals: dict[int, dict] = {}
        self.started: set[int] = set()

    def chunk(self, choices: list[dict], **extra) -> dict:
        return {"id": self.rid, "object": self.obj, "created": self.created, "model": self.req.model,
                "choices": choices, **extra}  # fmt: skip

    def wants_usage(self) -> bool:
        return bool(self.req.stream_options and self.req.stream_options.include_usage)

    def usage_chunk(self) -> dict:
        return self.chunk([], usage=usage_of([self.finals[i] for i in sorted(self.finals)], self.req.n))


class _CompletionStream(_Stream):
    """With `echo`, a choice's first chunk starts with its prompt (SGLang's rule). A chunk's
    `text_offset`s count from the start of all the choice's text, as the whole answer's do
    (`offsets`: per choice, where its next token starts)."""

    def __init__(self, tm: TokenizerManager, req: CompletionRequest, prompts: list) -> None:
        super().__init__(req, "cmpl", "text_completion")
        self.tm, self.prompts = tm, prompts
        self.offsets: dict[int, int] = {}

    def step(self, i: int, out: dict) -> dict | None:
        """The chunk of choice `i`'s new output, or None when nothing is new."""
        text, ids, lps = self.deltas.take(i, out)
        reason, matched = finish_reason_of(out)
        if not text and not ids and reason is None:
            return None
        first = i not in self.started
        lp = self._logprobs(i, out, lps, first) if self.req.logprobs is not None else None
        if first:
            self.started.add(i)
            text = echo_text(self.tm, self.prompts[i // self.req.n]) + text if self.req.echo else text
        if reason is not None:
            self.finals[i] = out
        return self.chunk([{"index": i, "text": text, "logprobs": lp, "finish_reason": reason,
                            "matched_stop": matched}])  # fmt: skip

    def _logprobs(self, i: int, out: dict, lps: tuple[list, list], first: bool) -> dict:
        tokens, tops = lps
        if first and self.req.echo:
            in_tokens, in_tops = logprobs_of(out, "input")
            tokens, tops = in_tokens + tokens, in_tops + tops
        lp = completion_logprobs(tokens, tops, self.req.logprobs, self.offsets.get(i, 0))
        self.offsets[i] = self.offsets.get(i, 0) + sum(len(t) for t in lp["tokens"])
        return lp


class _ChatStream(_Stream):
    """Per choice: a first chunk with the role, then its new text as deltas (with the parsers:
    `reasoning_content`, `content` and `tool_calls` pieces, SGLang's shapes), the step's logprobs
    on the first, the finish reason (`tool_calls` once a call was streamed) on the last."""

    def __init__(self, tm: TokenizerManager, req: ChatCompletionRequest) -> None:
        super().__init__(req, "chatcmpl", "chat.completion.chunk")
        self.parsing = output_parser(tm, req)
        self.streams: dict[int, StreamParser] = {}

    def start(self, i: int) -> dict | None:
        """The role chunk of choice `i` when this is its first output, else None."""
        if i in self.started:
            return None
        self.started.add(i)
        self.streams[i] = self.parsing.new_stream()
        return self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}])  # fmt: skip

    def step(self, i: int, out: dict) -> list[dict]:
        """The chunks of choice `i`'s new output (none while a parser holds it back)."""
        text, ids, lps = self.deltas.take(i, out)
        reason, matched = finish_reason_of(out)
        if not text and not ids and reason is None:
            return []
        lp = chat_logprobs(*lps, self.req.top_logprobs or 0) if self.req.logprobs else None
        if self.parsing.active:
            pieces = self.streams[i].step(text, reason is not None)
            if reason is None and not pieces and lp is None:
                return []
        else:
            pieces = [{"content": text}] if text else []
        if reason == "stop" and self.streams[i].has_tool_calls:
            reason, matched = "tool_calls", None
        return self._chunks(i, out, pieces or [{}], lp, reason, matched)

    def _chunks(self, i: int, out: dict, deltas: list[dict], lp, reason: str | None, matched) -> list[dict]:
        """One chunk a delta: the logprobs on the first, the finish reason on the last."""
        chunks = []
        for k, delta in enumerate(deltas):
            choice = {"index": i, "delta": delta, "logprobs": lp if k == 0 else None, "finish_reason": None}
            if k == len(deltas) - 1 and reason is not None:
                choice.update(finish_reason=reason, matched_stop=matched)
                self.finals[i] = out
            chunks.append(self.chunk([choice]))
        return chunks


async def completion_stream(
    tm: TokenizerManager, req: CompletionRequest, outs: AsyncIterator[tuple[int, dict]], prompts: list
) -> AsyncIterator[dict]:
    """Chunks of every choice as they come (see `_CompletionStream`), then the usage if asked."""
    stream = _CompletionStream(tm, req, prompts)
    async for i, out in outs:
        if is_abort(out):
            raise abort_to_error(out)
        chunk = stream.step(i, out)
        if chunk is not None:
            yield chunk
    if stream.wants_usage():
        yield stream.usage_chunk()


async def chat_stream(
    tm: TokenizerManager, req: ChatCompletionRequest, outs: AsyncIterator[tuple[int, dict]]
) -> AsyncIterator[dict]:
    """Per step and choice its chunks (see `_ChatStream`), then the usage if asked."""
    stream = _ChatStream(tm, req)
    async for i, out in outs:
        if is_abort(out):
            raise abort_to_error(out)
        role = stream.start(i)
        if role is not None:
            yield role
        for chunk in stream.step(i, out):
            yield chunk
    if stream.wants_usage():
        yield stream.usage_chunk()
