"""How far back a stop regex must look: `stop_regex` patterns are searched in the decoded tail
of the output after each token (SGLang's), a tail long enough for any match the pattern can make."""

from __future__ import annotations

import re._parser as regex_parser

MAX_BYTES_PER_CHAR = 4  # a character is at most 4 UTF-8 bytes, and no byte-level token is empty
UNBOUNDED_CHARS = 1 << 16  # past this, the whole output is searched


def stop_regex_window(patterns: list[str]) -> int | None:
    """The number of output tokens to decode and search (the longest match, in the worst case
    one token per byte, plus one token of context), or None for the whole output (a pattern
    whose match has no bound, such as `a+`)."""
    if not patterns:
        return 0
    widest = max(regex_parser.parse(p).getwidth()[1] for p in patterns)
    if widest > UNBOUNDED_CHARS:
        return None
    return widest * MAX_BYTES_PER_CHAR + 1
