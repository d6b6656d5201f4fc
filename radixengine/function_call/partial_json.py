"""JSON that may be cut short, as a streamed tool call has it (what SGLang reads with the
`partial_json_parser` package): the value so far, with every open object, array and (when asked)
string closed, and how many characters it used. An unfinished key, literal or number sign is left
out; a number at the very end counts as far as it is valid. `partial_json_text` writes such a
start out as json.dumps would, without closing it."""

from __future__ import annotations

import json
import re

from radixengine.utils.unicode_check import dumps_json_text

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_CHARS = set("0123456789+-.eE")
_WHITESPACE = " \t\n\r"
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LITERALS = {"t": ("true", True), "f": ("false", False), "n": ("null", None)}
_MISSING = object()


class MalformedJSON(ValueError):
    """Text that no continuation makes JSON."""


def partial_json_loads(text: str, allow_partial_strings: bool = True) -> tuple[object, int]:
    """The (possibly unfinished) JSON value at the start of `text` (after whitespace) and the
    number of characters it spans: up to its end when complete, else all of `text`. A string
    cut short is kept only with `allow_partial_strings` (else left out of its container)."""
    value, end, _ = _Reader(text, allow_partial_strings).value(_skip(text, 0))
    if value is _MISSING:
        raise MalformedJSON("no JSON value yet")
    return value, end


def partial_json_text(text: str) -> str:
    """The start of a JSON value cut short, written as `json.dumps` writes it (", " and ": "
    between items, strings re-escaped, non-ASCII kept) with nothing closed: what a tool call cut
    by max_tokens has of its arguments. An unfinished escape at the end is left out."""
    reader, out, i = _Reader(text, True), [], 0
    try:
        while i < len(text):
            c = text[i]
            if c == '"':
                value, i, complete = reader.string(i + 1)
                dumped = dumps_json_text(value)
                out.append(dumped if complete else dumped[:-1])
            elif c in _WHITESPACE:
                i += 1
            else:
                j = i + 1 if c in _PUNCTUATION else _token_end(text, i)
                out.append(_PUNCTUATION.get(c) or _number_or_literal(text[i:j], complete=j < len(text)))
                i = j
    except MalformedJSON:
        pass
    return "".join(out)


_PUNCTUATION = {",": ", ", ":": ": ", "{": "{", "}": "}", "[": "[", "]": "]"}


def _token_end(text: str, i: int) -> int:
    while i < len(text) and text[i] not in _WHITESPACE and text[i] not in _PUNCTUATION and text[i] != '"':
        i += 1
    return i


def _number_or_literal(token: str, complete: bool) -> str:
    """A whole number as json.dumps writes it (1.50 -> 1.5); a literal, or one cut short, as is."""
    if not complete:
        return token
    try:
        return json.dumps(json.loads(token))
    except ValueError:
        return token


def is_complete_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def find_common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


class _Reader:
    def __init__(self, text: str, allow_partial_strings: bool) -> None:
        self.s = text
        self.allow_str = allow_partial_strings

    def value(self, i: int) -> tuple[object, int, bool]:
        """(value or _MISSING, end, complete)."""
        s = self.s
        if i >= len(s):
            return _MISSING, i, False
        c = s[i]
        if c == "{":
            return self.obj(i + 1)
        if c == "[":
            return self.arr(i + 1)
        if c == '"':
            text, end, complete = self.string(i + 1)
            if not complete and not self.allow_str:
                return _MISSING, end, False
            return text, end, complete
        if c == "-" or c.isdigit():
            return self.number(i)
        if c in _LITERALS:
            word, value = _LITERALS[c]
            if s.startswith(word, i):
                return value, i + len(word), True
            if word.startswith(s[i:]):
                return _MISSING, len(s), False
        raise MalformedJSON(f"unexpected {c!r} at {i}")

    def obj(self, i: int) -> tuple[dict, int, bool]:
        s, out = self.s, {}
        i = _skip(s, i)
        if i < len(s) and s[i] == "}":
            return out, i + 1, True
        while True:
            i = _skip(s, i)
            if i >= len(s):
                return out, i, False
            if s[i] != '"':
                raise MalformedJSON(f"expected a key at {i}")
            key, i, complete = self.string(i + 1)
            if not complete:
                return out, i, False
            i = _skip(s, i)
            if i >= len(s):
                return out, i, False
            if s[i] != ":":
                raise MalformedJSON(f"expected ':' at {i}")
            value, i, complete = self.value(_skip(s, i + 1))
            if value is not _MISSING:
                out[key] = value
            if not complete:
                return out, i, False
            i = _skip(s, i)
            if i >= len(s):
                return out, i, False
            if s[i] == "}":
                return out, i + 1, True
            if s[i] != ",":
                raise MalformedJSON(f"expected ',' or '}}' at {i}")
            i += 1

    def arr(self, i: int) -> tuple[list, int, bool]:
        s, out = self.s, []
        i = _skip(s, i)
        if i < len(s) and s[i] == "]":
            return out, i + 1, True
        while True:
            value, i, complete = self.value(_skip(s, i))
            if value is not _MISSING:
                out.append(value)
            if not complete:
                return out, i, False
            i = _skip(s, i)
            if i >= len(s):
                return out, i, False
            if s[i] == "]":
                return out, i + 1, True
            if s[i] != ",":
                raise MalformedJSON(f"expected ',' or ']' at {i}")
            i += 1

    def string(self, i: int) -> tuple[str, int, bool]:
        """From after the opening quote: (text, end, complete); an unfinished escape at the end
        is left out."""
        s, parts = self.s, []
        while i < len(s):
            c = s[i]
            if c == '"':
                return "".join(parts), i + 1, True
            if c != "\\":
                parts.append(c)
                i += 1
                continue
            if i + 1 >= len(s):
                break
            e = s[i + 1]
            if e in _ESCAPES:
                parts.append(_ESCAPES[e])
                i += 2
                continue
            if e != "u":
                raise MalformedJSON(f"bad escape \\{e} at {i}")
            char, width = self.unicode_escape(i)
            if char is None:
                break
            parts.append(char)
            i += width
        return "".join(parts), len(s), False

    def unicode_escape(self, i: int) -> tuple[str | None, int]:
        """The character of the \\uXXXX escape (a surrogate pair takes two) at `i`, or None when
        the text ends inside it."""
        s = self.s
        hex4 = s[i + 2 : i + 6]
        if len(hex4) < 4:
            return None, 0
        try:
            code = int(hex4, 16)
        except ValueError:
            raise MalformedJSON(f"bad \\u escape at {i}") from None
        if 0xD800 <= code < 0xDC00:
            low = s[i + 6 : i + 12]
            if len(low) < 6 and "\\u".startswith(low[:2]):
                return None, 0
            if low.startswith("\\u"):
                try:
                    lo = int(low[2:], 16)
                except ValueError:
                    raise MalformedJSON(f"bad \\u escape at {i + 6}") from None
                if 0xDC00 <= lo < 0xE000:
                    return chr(0x10000 + ((code - 0xD800) << 10) + (lo - 0xDC00)), 12
        return chr(code), 6

    def number(self, i: int) -> tuple[object, int, bool]:
        s = self.s
        j = i
        while j < len(s) and s[j] in _NUMBER_CHARS:
            j += 1
        m = _NUMBER.match(s, i)
        matched = m.group(0) if m else ""
        if j == len(s):  # at the end: more digits may come
            return (json.loads(matched) if matched else _MISSING), j, False
        if i + len(matched) != j:
            raise MalformedJSON(f"bad number at {i}")
        return json.loads(matched), j, True
