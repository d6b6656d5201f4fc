"""`--log-requests`: SGLang's `Receive: obj=...` and `Finish: obj=..., out=...` lines, at info,
with its `--log-requests-level` (0: metadata, 1: + sampling parameters, 2: + input and output cut
to 2048 items, 3: everything)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from radixengine.managers.generate_output import GenerateOutput

logger = logging.getLogger(__name__)

_UNCUT = 1 << 30
_INPUT_FIELDS = {"text", "input_ids", "messages"}
_OUTPUT_FIELDS = {"text", "output_ids"}


class RequestLogger:
    def __init__(self, log_requests: bool, level: int) -> None:
        self.enabled = log_requests
        self.max_length = 2048 if level == 2 else _UNCUT
        self.skip: set[str] = set()
        self.out_skip: set[str] = set()
        if level <= 1:
            self.skip = _INPUT_FIELDS | ({"sampling_params"} if level == 0 else set())
            self.out_skip = _OUTPUT_FIELDS

    def log_received(self, obj: Any) -> None:
        if self.enabled:
            logger.info("Receive: obj=%s", truncated(obj, self.max_length, self.skip))

    def log_finished(self, obj: Any, out: GenerateOutput) -> None:
        if self.enabled:
            logger.info(
                "Finish: obj=%s, out=%s",
                truncated(obj, self.max_length, self.skip),
                truncated(out, self.max_length, self.out_skip),
            )


def truncated(data: Any, max_length: int, skip: set[str] | frozenset[str] = frozenset()) -> str:
    """`repr`-like text of `data`, strings and lists longer than `max_length` cut in the middle,
    the fields in `skip` (of the top-level dataclass or dict) left out."""
    if isinstance(data, str):
        if len(data) > max_length:
            half = max_length // 2
            return f"{data[:half]!r} ... {data[-half:]!r}"
        return repr(data)
    if isinstance(data, (list, tuple)):
        if len(data) > max_length:
            half = max_length // 2
            return f"{list(data[:half])} ... {list(data[-half:])}"
        return str(data)
    if isinstance(data, dict):
        items = (f"'{k}': {truncated(v, max_length)}" for k, v in data.items() if k not in skip)
        return "{" + ", ".join(items) + "}"
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        fields = (
            f"{f.name}={truncated(getattr(data, f.name), max_length)}"
            for f in dataclasses.fields(data)
            if f.name not in skip
        )
        return f"{type(data).__name__}(" + ", ".join(fields) + ")"
    return str(data)
