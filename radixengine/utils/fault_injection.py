"""Test-only fault injection: `RADIXENGINE_TEST_FAULT` makes the scheduler process fail on purpose, so
that containment and restart are tested through the real server.

    RADIXENGINE_TEST_FAULT="phase:n[:kind][,phase:n[:kind]...]"

`phase` is one of `PHASES`; the fault fires the `n`-th time (1-based) the scheduler process reaches
that phase (every scheduler process counts from 1: a restarted one fires again). `kind` is `raise`
(the default: an `InjectedFault` exception) or a signal name (`SIGKILL`, `SIGSEGV`, ...) the process
sends itself. Unset, each phase costs one check of an empty tuple. Never set it in production."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

ENV = "RADIXENGINE_TEST_FAULT"
PHASES = ("schedule", "prepare", "forward", "sample", "process", "grammar", "drafter", "cache_load")


class InjectedFault(RuntimeError):
    """The exception a `raise` fault raises."""


@dataclass(frozen=True)
class FaultSpec:
    phase: str
    step: int
    signal: int | None  # None: raise InjectedFault


def parse_faults(text: str) -> tuple[FaultSpec, ...]:
    """The faults of an `ENV` value; ValueError naming the variable for a malformed one."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        fields = item.split(":")
        if (
            len(fields) not in (2, 3)
            or fields[0] not in PHASES
            or not fields[1].isdigit()
            or int(fields[1]) < 1
        ):
            raise ValueError(
                f"{ENV}={text!r}: each fault is phase:n[:kind] with phase one of {', '.join(PHASES)} "
                "and n >= 1"
            )
        kind = fields[2] if len(fields) == 3 else "raise"
        faults.append(FaultSpec(fields[0], int(fields[1]), _signal_of(kind, text)))
    return tuple(faults)


def _signal_of(kind: str, text: str) -> int | None:
    if kind == "raise":
        return None
    try:
        return int(signal.Signals[kind])
    except KeyError:
        raise ValueError(
            f"{ENV}={text!r}: kind must be raise or a signal name (SIGKILL), not {kind!r}"
        ) from None


def check_env() -> None:
    """Refuse a malformed `ENV` before any process starts (ValueError naming it)."""
    parse_faults(os.environ.get(ENV, ""))


try:
    FAULTS: tuple[FaultSpec, ...] = parse_faults(os.environ.get(ENV, ""))
except ValueError:  # check_env() reports it at launch
    FAULTS = ()
_counts: dict[str, int] = {}


def fault_point(phase: str) -> None:
    """Where `phase` runs: fire the fault set for this occurrence, if any."""
    if not FAULTS:
        return
    n = _counts[phase] = _counts.get(phase, 0) + 1
    for fault in FAULTS:
        if fault.phase == phase and fault.step == n:
            if fault.signal is not None:
                os.kill(os.getpid(), fault.signal)
            raise InjectedFault(f"injected fault in the {phase} phase (occurrence {n}, {ENV})")
