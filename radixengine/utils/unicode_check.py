"""Where a decoded JSON value holds a string that UTF-8 cannot encode: JSON's `\\ud800` escape
gives Python a lone UTF-16 surrogate, which tokenizers, loggers and response encoders refuse."""

from __future__ import annotations

import json
import re


def is_utf8_encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def first_unencodable_path(value: object, root: str = "") -> str | None:
    """The JSON path (`stop`, `messages[0].content`, `sampling_params.stop[1]`) of the first string,
    or object key, UTF-8 cannot encode; None when there is none. The path of a bad key is its
    object's; `root` names the value itself (`""`: the body). Walks without recursion, so any
    nesting depth is safe."""
    stack: list[tuple[object, str]] = [(value, root)]
    while stack:
        item, path = stack.pop()
        if not _own_text_encodable(item):
            return path or "body"
        stack.extend(_children(item, path))
    return None


_NESTED = (str, dict, list, tuple)  # the values that may hold a string


def _own_text_encodable(item: object) -> bool:
    """Whether a string, or an object's keys, UTF-8 can encode (true of any other value)."""
    if isinstance(item, str):
        return is_utf8_encodable(item)
    if isinstance(item, dict):
        return all(is_utf8_encodable(k) for k in item if isinstance(k, str))
    return True


def _children(item: object, path: str) -> list[tuple[object, str]]:
    """An object's or array's values that may hold a string, with their paths, last first."""
    if isinstance(item, dict):
        return [
            (child, f"{path}.{key}" if path else str(key))
            for key, child in reversed(item.items())
            if isinstance(child, _NESTED)
        ]
    if isinstance(item, (list, tuple)):
        return [
            (child, f"{path}[{i}]")
            for i, child in reversed(list(enumerate(item)))
            if isinstance(child, _NESTED)
        ]
    return []


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def escape_lone_surrogates(json_text: str) -> str:
    """JSON text with each lone surrogate (only a string can hold one) written as its `\\uXXXX`
    escape: the same JSON value, in text UTF-8 can encode."""
    if is_utf8_encodable(json_text):
        return json_text
    return _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", json_text)


def encode_json_text(value: object, **kwargs) -> bytes:
    """`dumps_json_text(value)` as UTF-8, encoded once when the text has no lone surrogate (the
    response hot path)."""
    text = json.dumps(value, ensure_ascii=False, **kwargs)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return escape_lone_surrogates(text).encode("utf-8")


def dumps_json_text(value: object, **kwargs) -> str:
    """`json.dumps(value, ensure_ascii=False)` that UTF-8 can always encode: a string decoded from
    a model's `\\ud83d` escape keeps it as that escape."""
    return escape_lone_surrogates(json.dumps(value, ensure_ascii=False, **kwargs))
