"""The answers of /v1/responses built from the chat path's: a chat completion -> a Response object
(reasoning, message and function_call output items, usage with cached tokens), and chat stream
chunks -> the Responses event sequence (response.created ... response.completed)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from radixengine.entrypoints.openai_protocol import now
from radixengine.entrypoints.responses_protocol import ResponsesRequest


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def base_response(req: ResponsesRequest, response_id: str, status: str) -> dict:
    """The Response object without output and usage: what the request asked for, echoed."""
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {
        "id": response_id,
        "object": "response",
        "created_at": now(),
        "status": status,
        "background": req.background,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": req.model,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
        "store": req.store,
        "temperature": req.temperature,
        "text": {"format": fmt},
        "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
        "tools": req.tools or [],
        "top_p": req.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": req.user,
        "metadata": req.metadata or {},
    }


@dataclass(frozen=True)
class UsageCounter:
    """What a Response's usage needs beyond the chat usage: the reasoning text's token count, and
    whether the prompt's computed tokens are written to the cache (the radix cache keeps them)."""

    count_tokens: Callable[[str], int]
    caches_prompts: bool

    def usage(self, chat_usage: dict, reasoning: str) -> dict:
        """OpenAI's ResponseUsage: `cached_tokens` read from the radix cache, `cache_write_tokens`
        the prompt's others, which it keeps (0 with --disable-radix-cache)."""
        cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        written = chat_usage["prompt_tokens"] - cached if self.caches_prompts else 0
        return {
            "input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": self.count_tokens(reasoning) if reasoning else 0},
            "total_tokens": chat_usage["total_tokens"],
        }


def reasoning_item(text: str, status: str = "completed", rid: str | None = None) -> dict:
    return {"id": rid or item_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}  # fmt: skip


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str, status: str = "completed", mid: str | None = None) -> dict:
    return {"id": mid or item_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)]}  # fmt: skip


def function_call_item(call: dict, status: str = "completed", fid: str | None = None) -> dict:
    return {"id": fid or item_id("fc"), "type": "function_call", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": status}  # fmt: skip


def output_items(message: dict, status: str) -> list[dict]:
    """A chat answer's message as output items: reasoning, then text, then the calls; the last
    item takes `status` (incomplete: max_output_tokens cut it, a call's arguments included)."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(message.get("content") or ""))
    items.extend(function_call_item(call) for call in calls)
    items[-1]["status"] = status
    return items


def finish(response: dict, finish_reason: str | None, output: list[dict], usage: dict) -> dict:
    """The response once its answer is there: completed, or incomplete at max_output_tokens."""
    response.update(output=output, usage=usage, status="completed")
    if finish_reason == "length":
        response.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    response["completed_at"] = now()
    return response


def assistant_messages(output: list[dict]) -> list[dict]:
    """The output as the chat messages a continuation (previous_response_id) starts from."""
    message: dict = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "reasoning":
            message["reasoning_content"] = "".join(p["text"] for p in item["content"])
        elif item["type"] == "message":
            message["content"] += "".join(p["text"] for p in item["content"])
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            message.setdefault("tool_calls", []).append(call)
    return [message]


def response_from_chat(base: dict, chat: dict, counter: UsageCounter) -> dict:
    """A whole chat completion (one choice) as the finished response."""
    choice = chat["choices"][0]
    message = choice["message"]
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    usage = counter.usage(chat["usage"], message.get("reasoning_content") or "")
    return finish(base, choice["finish_reason"], output_items(message, status), usage)


class ResponseEvents:
    """Chat stream chunks -> Responses events. One output item is open at a time: reasoning text,
    message text, or one function call; a delta of another kind closes it and opens the next."""

    def __init__(self, response: dict, counter: UsageCounter) -> None:
        self.response = response
        self.counter = counter
        self.seq = 0
        self.output: list[dict] = []
        self.open: dict | None = None
        self.finish_reason: str | None = None
        self.chat_usage: dict | None = None

    def event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def start(self) -> list[dict]:
        self.response["status"] = "in_progress"
        return [self.event("response.created", response=dict(self.response)),
                self.event("response.in_progress", response=dict(self.response))]  # fmt: skip

    def on_chunk(self, chunk: dict) -> list[dict]:
        if chunk.get("usage"):
            self.chat_usage = chunk["usage"]
        events: list[dict] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def _index(self) -> int:
        return len(self.output) - 1

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            item = (
                reasoning_item("", "in_progress") if kind == "reasoning" else message_item("", "in_progress")
            )
            part = item["content"].pop()  # the item is announced empty, then its part
            events += self._open_item(item)
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=self._index(), content_index=0, part=dict(part)))  # fmt: skip
            item["content"].append(part)
        if not text:
            return events
        self.open["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.event(name, item_id=self.open["id"], output_index=self._index(), content_index=0,
                                 delta=text, **extra))  # fmt: skip
        return events

    def _call(self, call: dict) -> list[dict]:
        events = []
        if call.get("id"):
            events += self._close()
            item = function_call_item(
                {**call, "function": {**call["function"], "arguments": ""}}, "in_progress"
            )
            events += self._open_item(item)
        arguments = call["function"].get("arguments") or ""
        if arguments and self.open is not None and self.open["type"] == "function_call":
            self.open["arguments"] += arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                     output_index=self._index(), delta=arguments))  # fmt: skip
        return events

    def _open_item(self, item: dict) -> list[dict]:
        self.output.append(item)
        self.open = item
        return [self.event("response.output_item.added", output_index=self._index(), item=_copy(item))]

    def _close(self, last: bool = False) -> list[dict]:
        """Close the open item: the last one is incomplete when max_output_tokens cut it."""
        item, self.open = self.open, None
        if item is None:
            return []
        index, events = self.output.index(item), []
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, name=item["name"], arguments=item["arguments"]))  # fmt: skip
        else:
            part = item["content"][0]
            done = (
                "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            )
            extra = {} if item["type"] == "reasoning" else {"logprobs": []}
            events.append(self.event(done, item_id=item["id"], output_index=index, content_index=0,
                                     text=part["text"], **extra))  # fmt: skip
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=dict(part)))  # fmt: skip
        item["status"] = "incomplete" if last and self.finish_reason == "length" else "completed"
        events.append(self.event("response.output_item.done", output_index=index, item=_copy(item)))
        return events

    def end(self) -> list[dict]:
        """Close the open item (an empty message when nothing came) and complete the response."""
        events = []
        if not self.output:
            events += self._text("message", "")
        events += self._close(last=True)
        reasoning = "".join(i["content"][0]["text"] for i in self.output if i["type"] == "reasoning")
        usage = self.counter.usage(self.chat_usage, reasoning)
        finish(self.response, self.finish_reason, self.output, usage)
        kind = "response.incomplete" if self.response["status"] == "incomplete" else "response.completed"
        events.append(self.event(kind, response=self.response))
        return events


def _copy(item: dict) -> dict:
    copied = dict(item)
    if "content" in copied:
        copied["content"] = [dict(p) for p in copied["content"]]
    return copied


async def response_events(events: ResponseEvents, chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """The whole event sequence. The first chunk is awaited before response.created, so that a
    request the engine refuses is still an HTTP error."""
    first = await anext(chunks, None)
    for event in events.start():
        yield event
    if first is not None:
        for event in events.on_chunk(first):
            yield event
        async for chunk in chunks:
            for event in events.on_chunk(chunk):
                yield event
    for event in events.end():
        yield event
