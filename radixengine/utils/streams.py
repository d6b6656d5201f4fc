"""Device streams and events behind one small interface, so the overlap loop is the same code on
CUDA and on a CPU.

- `stream.submit(fn, *args)` runs `fn` on the stream, after everything submitted before it.
- `stream.record_event()` returns an event that completes when the stream reaches it; the host
  waits with `event.synchronize()`, another stream with `other.wait_event(event)`.
- `stream.wait_stream(other)`: later work on `stream` runs after what `other` has so far.

CUDA: `torch.cuda.Stream` / `torch.cuda.Event`; `submit` runs `fn` on the calling thread with the
stream current (kernels run asynchronously). CPU: the host stream runs work at once; a
`CpuStream` is one worker thread that runs submitted work in order (torch releases the GIL inside
its kernels, so the host thread really runs alongside). An exception in the worker is kept and
raised at the next `synchronize()` (of any of the stream's events, or the stream), never dropped;
work submitted after a failure is skipped, events are still completed, so nothing hangs.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from radixengine.utils.stream_layouts import CPU_STREAM_LAYOUTS


class StreamError(RuntimeError):
    """Work on a stream raised; the original exception is the cause."""


class Event(Protocol):
    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class Stream(Protocol):
    def submit(self, fn: Callable[..., Any], *args: Any, label: str | None = None) -> None: ...

    def record_event(self) -> Event: ...

    def wait_event(self, event: Event) -> None: ...

    def wait_stream(self, other: Stream) -> None: ...

    def synchronize(self) -> None: ...


# CPU --------------------------------------------------------------------------------------------


class CpuEvent:
    def __init__(self, stream: CpuStream | None = None) -> None:
        self._done = threading.Event()
        self._stream = stream

    def synchronize(self, timeout: float | None = None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError("event not reached")
        if self._stream is not None:
            self._stream.raise_if_failed()

    def query(self) -> bool:
        return self._done.is_set()

    def _set(self) -> None:
        self._done.set()


class HostStream:
    """The CPU's default stream: work runs at once on the calling thread (busy intervals kept in
    `busy`, as CpuStream does)."""

    def __init__(self, max_intervals: int = 100_000) -> None:
        self.busy: deque[tuple[float, float, str]] = deque(maxlen=max_intervals)

    def submit(self, fn: Callable[..., Any], *args: Any, label: str | None = None) -> None:
        start = time.perf_counter()
        fn(*args)
        self.busy.append((start, time.perf_counter(), label or getattr(fn, "__name__", "work")))

    def record_event(self) -> CpuEvent:
        event = CpuEvent()
        event._set()
        return event

    def wait_event(self, event: Event) -> None:
        event.synchronize()

    def wait_stream(self, other: Stream) -> None:
        other.synchronize()

    def synchronize(self) -> None:
        pass


_MARK = object()  # queue entries: (fn, args, label) or (_MARK, event, None) or None to stop


class CpuStream:
    """One worker thread running submitted work in order. Keeps the busy interval of each piece of
    work (perf_counter seconds, label) in `busy` (bounded) for timing."""

    def __init__(self, name: str = "forward", max_intervals: int = 100_000) -> None:
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self.busy: deque[tuple[float, float, str]] = deque(maxlen=max_intervals)
        self._thread = threading.Thread(target=self._run, name=f"{name}-stream", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args, label = item
            if fn is _MARK:
                args._set()
                continue
            if self._error is not None:
                continue  # its inputs may come from the failed work
            start = time.perf_counter()
            try:
                fn(*args)
            except BaseException as e:  # kept for the next synchronize
                self._error = e
            self.busy.append((start, time.perf_counter(), label or getattr(fn, "__name__", "work")))

    def submit(self, fn: Callable[..., Any], *args: Any, label: str | None = None) -> None:
        if not self._thread.is_alive():
            raise StreamError(f"{self.name} stream is closed")
        self._queue.put((fn, args, label))

    def record_event(self) -> CpuEvent:
        event = CpuEvent(self)
        if not self._thread.is_alive():
            event._set()
        else:
            self._queue.put((_MARK, event, None))
        return event

    def wait_event(self, event: Event) -> None:
        self.submit(event.synchronize, label="wait")

    def wait_stream(self, other: Stream) -> None:
        if not isinstance(other, HostStream):
            self.wait_event(other.record_event())

    def synchronize(self) -> None:
        self.record_event().synchronize()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise StreamError(f"work on the {self.name} stream failed: {self._error!r}") from self._error

    def reset_error(self) -> None:
        """Accept new work again after a failure was handled."""
        self._error = None

    def close(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)


# CUDA -------------------------------------------------------------------------------------------


class CudaEvent:
    def __init__(self, stream: torch.cuda.Stream, timing: bool = False) -> None:
        self.event = torch.cuda.Event(enable_timing=timing)
        self.event.record(stream)

    def synchronize(self) -> None:
        self.event.synchronize()

    def query(self) -> bool:
        return self.event.query()


class CudaStream:
    def __init__(
        self, device: torch.device | str | None = None, stream: torch.cuda.Stream | None = None
    ) -> None:
        self.stream = stream if stream is not None else torch.cuda.Stream(device=device)
        # (start event, end event, label) per piece of work, once `enable_timing()`; bounded.
        self.busy_events: deque[tuple[torch.cuda.Event, torch.cuda.Event, str]] = deque(maxlen=100_000)
        self.timing = False
        self._anchor: tuple[torch.cuda.Event, float] | None = None

    def enable_timing(self) -> None:
        """Record an event pair around each piece of work (for `busy`)."""
        self.stream.synchronize()
        base = CudaEvent(self.stream, timing=True).event
        base.synchronize()
        self._anchor = (base, time.perf_counter())
        self.timing = True

    @property
    def busy(self) -> list[tuple[float, float, str]]:
        """Busy intervals in perf_counter seconds (synchronizes the stream)."""
        if self._anchor is None:
            return []
        self.stream.synchronize()
        base, t0 = self._anchor
        return [
            (t0 + base.elapsed_time(s) / 1e3, t0 + base.elapsed_time(e) / 1e3, label)
            for s, e, label in self.busy_events
        ]

    def submit(self, fn: Callable[..., Any], *args: Any, label: str | None = None) -> None:
        with torch.cuda.stream(self.stream):
            if not self.timing:
                fn(*args)
                return
            start = CudaEvent(self.stream, timing=True)
            fn(*args)
            end = CudaEvent(self.stream, timing=True)
            self.busy_events.append((start.event, end.event, label or getattr(fn, "__name__", "work")))

    def record_event(self) -> CudaEvent:
        return CudaEvent(self.stream)

    def wait_event(self, event: Event) -> None:
        if isinstance(event, CudaEvent):
            self.stream.wait_event(event.event)
        else:
            event.synchronize()

    def wait_stream(self, other: Stream) -> None:
        if isinstance(other, CudaStream):
            self.stream.wait_stream(other.stream)
        else:
            other.synchronize()

    def synchronize(self) -> None:
        self.stream.synchronize()

    def raise_if_failed(self) -> None:
        pass

    def close(self, timeout: float = 10.0) -> None:
        self.stream.synchronize()


# Factories --------------------------------------------------------------------------------------


def get_default_stream(device: torch.device | str) -> Stream:
    device = torch.device(device)
    if device.type == "cuda":
        return CudaStream(stream=torch.cuda.current_stream(device))
    return HostStream()


def new_stream(device: torch.device | str, name: str = "forward", cpu_layout: str = "thread") -> Stream:
    """A new stream on `device`. On a CPU, `cpu_layout` picks where its work runs: "thread" (a
    worker thread), "inline" (at once on the caller: the overlap loop keeps its order but nothing
    runs alongside), or "auto": a thread only when the intra-op threads leave a core free for
    the caller. Measured on 2 cores: a worker thread beside 2 intra-op threads makes decode
    30-55% slower (the threads fight over the cores), inline costs nothing."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaStream(device)
    return CpuStream(name) if resolve_cpu_layout(cpu_layout) == "thread" else HostStream()


def resolve_cpu_layout(cpu_layout: str, num_threads: int | None = None) -> str:
    """What `new_stream` makes of `cpu_layout` ("thread" or "inline") with `num_threads` intra-op
    threads (None: torch's current count)."""
    if cpu_layout not in CPU_STREAM_LAYOUTS:
        raise ValueError(f"unknown CPU stream layout {cpu_layout!r}; one of {', '.join(CPU_STREAM_LAYOUTS)}")
    if cpu_layout != "auto":
        return cpu_layout
    threads = num_threads if num_threads is not None else torch.get_num_threads()
    return "thread" if threads < available_cores() else "inline"


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@contextmanager
def stream_context(stream: Stream):
    """Make `stream` current for device work issued in the block (CUDA); a no-op on the CPU,
    where work goes to a stream only through `submit`."""
    if isinstance(stream, CudaStream):
        with torch.cuda.stream(stream.stream):
            yield
    else:
        yield
