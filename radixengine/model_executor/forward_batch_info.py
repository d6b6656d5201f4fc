"""ForwardMode and ForwardBatch: what one forward pass of the model needs."""

from __future__ import annotations

from enum import IntEnum, auto


class ForwardMode(IntEnum):
    EXTEND = auto()  # prefill, possibly over a cached prefix
    DECODE = auto()  # one new token per request
    IDLE = auto()  # nothing to run

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE
