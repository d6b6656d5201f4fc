"""The input items of a stored response (`GET /v1/responses/{id}/input_items`, OpenAI's): the
request's own `input` as Responses items, each with an id (the client's, or one made here), and
the cursor pages of that list (`after`, `limit`, `order`)."""

from __future__ import annotations

import uuid

from radixengine.managers.request_errors import RequestError

MAX_PAGE = 100  # OpenAI's bound on `limit`
ORDERS = ("asc", "desc")


def input_items(request_input: str | list[dict]) -> list[dict]:
    """The request's input (already checked by `input_messages`) as the items the API lists."""
    if isinstance(request_input, str):
        return [_message({"role": "user", "content": request_input})]
    return [_ITEMS[_kind(item)](item) for item in request_input]


def page_of(items: list[dict], after: str | None, limit: int, order: str) -> dict:
    """One page of `items` (OpenAI's list object): `order` desc (the default) lists the last input
    first; `after` is the id of the item the page follows."""
    if order not in ORDERS:
        raise RequestError(f"order must be asc or desc; got {order!r}", param="order")
    if not 1 <= limit <= MAX_PAGE:
        raise RequestError(f"limit must be between 1 and {MAX_PAGE}; got {limit}", param="limit")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise RequestError(f"after {after!r} is not an input item of this response", param="after")
        start = ids.index(after) + 1
    page = ordered[start : start + limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(ordered),
    }


def _kind(item: dict) -> str:
    return item.get("type", "message" if "role" in item else "")


def _id(item: dict, prefix: str) -> str:
    given = item.get("id")
    return given if isinstance(given, str) and given else f"{prefix}_{uuid.uuid4().hex}"


def _message(item: dict) -> dict:
    role, content = item["role"], item.get("content")
    texts = [content] if isinstance(content, str) else [p.get("text", "") for p in content or []]
    if role == "assistant":
        parts = [{"type": "output_text", "text": t, "annotations": []} for t in texts]
    else:
        parts = [{"type": "input_text", "text": t} for t in texts]
    return {"id": _id(item, "msg"), "type": "message", "role": role, "status": "completed", "content": parts}


def _function_call(item: dict) -> dict:
    return {"id": _id(item, "fc"), "type": "function_call", "call_id": item["call_id"], "name": item["name"],
            "arguments": item["arguments"], "status": "completed"}  # fmt: skip


def _function_call_output(item: dict) -> dict:
    return {"id": _id(item, "fco"), "type": "function_call_output", "call_id": item["call_id"],
            "output": item["output"], "status": "completed"}  # fmt: skip


def _reasoning(item: dict) -> dict:
    content = [{"type": "reasoning_text", "text": p.get("text", "")} for p in item.get("content") or []]
    return {
        "id": _id(item, "rs"),
        "type": "reasoning",
        "summary": item.get("summary") or [],
        "content": content,
    }


_ITEMS = {
    "message": _message,
    "function_call": _function_call,
    "function_call_output": _function_call_output,
    "reasoning": _reasoning,
}
