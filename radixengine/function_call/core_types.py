"""What the detectors return (SGLang's core_types)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class ToolCallItem:
    """One call, or one piece of it while streaming: the first piece of a call carries its
    `name` (and empty `parameters`), the next ones fragments of its arguments' JSON text."""

    tool_index: int
    parameters: str  # JSON text (a fragment while streaming)
    name: str | None = None


@dataclass
class StreamingParseResult:
    normal_text: str = ""
    calls: list[ToolCallItem] = field(default_factory=list)


@dataclass
class StructureInfo:
    """How a call of one function is written in a model's format: `begin` + arguments JSON +
    `end`; `trigger` is the text that opens any call."""

    begin: str
    end: str
    trigger: str


GetInfoFunc = Callable[[str], StructureInfo]
