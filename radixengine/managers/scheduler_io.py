"""The scheduler's I/O: one small object it reads requests from and writes outputs to, so the same
`Scheduler` runs in-process (tests, benchmarks) and in its own process (engine, server)."""

from __future__ import annotations

import threading
from collections import deque
from typing import Protocol


class SchedulerIOClosed(Exception):
    """Raised by `recv` once the I/O is closed: the event loop returns."""


class SchedulerIO(Protocol):
    def recv(self, block: bool) -> list[object]:
        """Pending messages; if `block`, waits (briefly) for at least one."""
        ...

    def send(self, msg: object) -> None:
        """BatchTokenIDOut, FlushCacheReqOutput, GetInternalStateReqOutput, ..."""
        ...


class InProcessIO:
    """Queues in memory. A test puts requests with `put` and reads what the scheduler sent from
    `outputs` (or `take_outputs`); `close` makes the event loop return."""

    def __init__(self, block_timeout: float = 0.05) -> None:
        self.block_timeout = block_timeout
        self.inbox: deque[object] = deque()
        self.outputs: list[object] = []
        self._cond = threading.Condition()
        self._closed = False

    def put(self, *msgs: object) -> None:
        with self._cond:
            self.inbox.extend(msgs)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def recv(self, block: bool) -> list[object]:
        with self._cond:
            if block and not self.inbox and not self._closed:
                self._cond.wait(self.block_timeout)
            if self._closed and not self.inbox:
                raise SchedulerIOClosed
            msgs = list(self.inbox)
            self.inbox.clear()
            return msgs

    def send(self, msg: object) -> None:
        with self._cond:
            self.outputs.append(msg)

    def take_outputs(self) -> list[object]:
        with self._cond:
            out, self.outputs = self.outputs, []
            return out
