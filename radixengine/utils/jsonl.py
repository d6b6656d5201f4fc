"""JSON Lines as OpenAI's and vLLM's batch files are read: a line ends at `\\n` only (a `\\r` before
it is dropped). `str.splitlines()` also ends lines at `\\x0b`, `\\x0c`, `\\x1c`-`\\x1e`, U+0085, U+2028
and U+2029; the last three a JSON string may hold unescaped (`json.dumps(..., ensure_ascii=False)`
writes them so), and split there one valid line becomes two invalid ones."""

from __future__ import annotations

from collections.abc import Iterable, Iterator


def numbered_lines(lines: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    """The non-blank lines of `lines` (as a binary file or `data.split(b"\\n")` yields them),
    each with its line number (from 1), without its `\\n` or a `\\r` before it."""
    for n, raw in enumerate(lines, start=1):
        raw = raw.removesuffix(b"\n").removesuffix(b"\r")
        if raw.strip():
            yield n, raw


def decode_line(raw: bytes) -> str:
    """The line as text; ValueError naming the first byte that is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not valid UTF-8 (byte {e.start + 1}: {raw[e.start : e.start + 1]!r})") from None
