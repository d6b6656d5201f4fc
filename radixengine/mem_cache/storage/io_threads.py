"""The storage tier's background threads: writes and prefetches run off the scheduler's thread.

`StorageWriter` takes pages already copied out of the KV pool (no pool slot is held while a page
waits), through a queue bounded in bytes: a page past the bound is dropped, never waited for.
`StoragePrefetcher` reads the pages that follow a prefix, in order, into host memory, stopping
at the first page storage does not have; the cache takes what has arrived when the request is
admitted (the prefetch policy says how long to wait for the rest).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from radixengine.mem_cache.storage.base import HiCacheStorage

logger = logging.getLogger(__name__)

MAX_HUNG_READERS = 4  # reads that never returned; past this many, prefetching stops


@dataclass(frozen=True)
class _Write:
    key: str
    tokens: tuple[int, ...]
    page: torch.Tensor

    def nbytes(self) -> int:
        return self.page.numel() * self.page.element_size()


@dataclass(frozen=True)
class _Touch:
    keys: list[str]


class StorageWriter:
    """Writes pages (a page already in storage is not written again: it is touched, so the size
    bound sees it used) and touches the pages of cache hits, in submission order."""

    def __init__(self, storage: HiCacheStorage, max_pending_bytes: int = 256 << 20) -> None:
        self.storage = storage
        self.queue: queue.Queue = queue.Queue()
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0  # of pages submitted and not written yet (the bound)
        self._lock = threading.Lock()
        self.submitted = 0
        self.written = 0
        self.present = 0  # submitted pages storage already had
        self.dropped = 0
        self.failed = 0
        self._failed_keys: deque[str] = deque()  # not stored after all; taken by the cache
        self.thread = threading.Thread(target=self._run, name="hicache-writer", daemon=True)
        self.thread.start()

    def submit(self, key: str, tokens: tuple[int, ...], page: torch.Tensor) -> bool:
        """Queue a page; False (dropped) if the pages waiting already hold the byte bound."""
        item = _Write(key, tokens, page)
        with self._lock:
            if self.pending_bytes + item.nbytes() > self.max_pending_bytes:
                self.dropped += 1
                return False
            self.pending_bytes += item.nbytes()
        self.submitted += 1
        self.queue.put(item)
        return True

    def touch(self, keys: list[str]) -> None:
        """These stored pages were just used (from the device or the host tier)."""
        self.queue.put(_Touch(keys))

    def take_failed(self) -> list[str]:
        """Keys submitted whose write failed since the last call."""
        keys = []
        while self._failed_keys:
            keys.append(self._failed_keys.popleft())
        return keys

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                self._do(item)
            except Exception:  # a backend bug must not end the thread: the page is not stored
                logger.exception("hicache storage: writing a page failed")
                if isinstance(item, _Write):
                    self._fail(item.key)
            finally:
                if isinstance(item, _Write):
                    with self._lock:
                        self.pending_bytes -= item.nbytes()
                self.queue.task_done()

    def _do(self, item: _Write | _Touch) -> None:
        if isinstance(item, _Touch):
            for key in item.keys:
                self.storage.touch(key)
        elif self.storage.touch(item.key):
            self.present += 1
        elif self.storage.set(item.key, item.tokens, item.page):
            self.written += 1
        else:
            self._fail(item.key)

    def _fail(self, key: str) -> None:
        self.failed += 1
        self._failed_keys.append(key)

    def queued(self) -> int:
        """Pages submitted and not written yet."""
        return self.queue.unfinished_tasks

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted page is written (or failed), at most `timeout_s` (None: no
        bound); returns whether the queue drained."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.queue.all_tasks_done:
            while self.queue.unfinished_tasks:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self.queue.all_tasks_done.wait(remaining)
        return True

    def close(self, timeout_s: float | None = None) -> None:
        """Write what is queued (at most `timeout_s`), then stop the thread."""
        if not self.flush(timeout_s):
            logger.warning(
                "hicache storage: stopping with %d pages not written after %.1f s; they are lost",
                self.queued(),
                timeout_s,
            )
        self.queue.put(None)
        self.thread.join(1.0)


@dataclass(eq=False)
class PrefetchOp:
    """The read of one request's pages `first_page`, `first_page + 1`, ... (keys of its own hash
    chain), in order, stopping at the first page storage does not have."""

    rid: str
    first_page: int
    keys: list[str]
    tokens: list[tuple[int, ...]]
    reserved_bytes: int = 0
    pages: list[torch.Tensor] = field(default_factory=list)  # found so far, in order
    done: threading.Event = field(default_factory=threading.Event)
    revoked: bool = False  # its request left or gave up on it: read nothing more
    reading: bool = False  # a reader thread is inside storage.get for it
    created: float = field(default_factory=time.monotonic)
    last_progress: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wait(self, timeout: float | None) -> None:
        self.done.wait(timeout)

    def arrived(self) -> list[torch.Tensor]:
        with self.lock:
            return list(self.pages)


@dataclass
class _Reader:
    thread: threading.Thread | None = None
    retired: bool = False  # a read of a given-up prefetch hangs in it; another reader took over
    op: PrefetchOp | None = None


class StoragePrefetcher:
    """One prefetch per request (by request id), read by `num_readers` threads. The pages of the
    prefetches held are bounded in bytes (`max_bytes`, SGLang's prefetch_capacity_limit): a
    prefetch reads at most the pages that fit, reserved when it starts and released with it.
    A read that never returns (a hung mount) holds one reader: giving up on its prefetch starts
    another reader, at most `MAX_HUNG_READERS` times; past that, prefetching stops."""

    def __init__(
        self, storage: HiCacheStorage, max_bytes: int, page_bytes: int, num_readers: int = 2
    ) -> None:
        self.storage = storage
        self.max_bytes = max_bytes
        self.page_bytes = page_bytes
        self.reserved_bytes = 0  # scheduler thread only
        self.queue: queue.Queue = queue.Queue()
        self._ops: dict[str, PrefetchOp] = {}  # by request id; scheduler thread only
        self._readers: list[_Reader] = []
        self.hung_readers = 0
        self.started = 0
        self._progress = threading.Condition()
        self.truncated = 0  # prefetches cut short by the byte bound
        self.given_up = 0  # prefetches not finished in time
        self.pages_read = 0
        self.misses = 0  # prefetches that stopped at a page storage does not have
        for _ in range(num_readers):
            self._start_reader()

    def _start_reader(self) -> None:
        reader = _Reader()
        reader.thread = threading.Thread(
            target=self._run, args=(reader,), name="hicache-prefetch", daemon=True
        )
        self._readers.append(reader)
        reader.thread.start()

    def request(
        self, rid: str, first_page: int, keys: list[str], tokens: list[tuple[int, ...]]
    ) -> PrefetchOp | None:
        """Start the prefetch of request `rid` (replacing one it had); None if no page fits in
        the byte bound or prefetching has stopped."""
        self.release(rid)
        if self.hung_readers > MAX_HUNG_READERS:
            return None
        room = (self.max_bytes - self.reserved_bytes) // self.page_bytes
        num = min(len(keys), max(room, 0))
        if num < len(keys):
            self.truncated += 1
        if num == 0:
            return None
        op = PrefetchOp(rid, first_page, list(keys[:num]), list(tokens[:num]), num * self.page_bytes)
        self.reserved_bytes += op.reserved_bytes
        self._ops[rid] = op
        self.started += 1
        self.queue.put(op)
        return op

    def get(self, rid: str) -> PrefetchOp | None:
        return self._ops.get(rid)

    def release(self, rid: str) -> None:
        """Request `rid` left or took its pages: revoke its prefetch and let its pages go."""
        op = self._ops.pop(rid, None)
        if op is None:
            return
        with op.lock:
            op.revoked = True
            op.pages.clear()
        self.reserved_bytes -= op.reserved_bytes

    def give_up(self, op: PrefetchOp) -> None:
        """Its request stops waiting for `op`; a read of it still in progress hangs: another
        reader takes over from the one holding it."""
        self.given_up += 1
        with op.lock:
            op.revoked = True
            hung = op.reading
        if not hung:
            return
        for reader in self._readers:
            if reader.op is op and not reader.retired:
                reader.retired = True
                self.hung_readers += 1
                if self.hung_readers > MAX_HUNG_READERS:
                    logger.warning(
                        "hicache storage: %d reads from storage never returned; prefetching stops "
                        "(prefixes are recomputed)",
                        self.hung_readers,
                    )
                    return
                logger.warning(
                    "hicache storage: a read of %s has not returned; reading on in another thread",
                    self.storage.describe(
                        op.keys[len(op.pages)] if len(op.pages) < len(op.keys) else op.keys[-1]
                    ),
                )
                self._start_reader()
                return

    def wait_progress(self, timeout_s: float) -> None:
        """Wait at most `timeout_s` for a page to arrive or a prefetch to end."""
        with self._progress:
            self._progress.wait(timeout_s)

    def _notify(self) -> None:
        with self._progress:
            self._progress.notify_all()

    def held_bytes(self) -> int:
        """Bytes of the pages the held prefetches have read."""
        return sum(len(op.pages) for op in self._ops.values()) * self.page_bytes

    def num_ops(self) -> int:
        return len(self._ops)

    def _run(self, reader: _Reader) -> None:
        while not reader.retired:
            op = self.queue.get()
            if op is None:
                return
            reader.op = op
            try:
                self._read(op)
            except Exception:
                logger.exception("hicache storage: prefetch failed")
            finally:
                reader.op = None
                op.done.set()
                self._notify()

    def _read(self, op: PrefetchOp) -> None:
        for key, tokens in zip(op.keys, op.tokens):
            with op.lock:
                if op.revoked:
                    return
                op.reading = True
            page = self.storage.get(key, tokens)
            with op.lock:
                op.reading = False
                self.misses += page is None and not op.revoked
                if page is None or op.revoked:
                    return
                op.pages.append(page)
                self.pages_read += 1
                op.last_progress = time.monotonic()
            self._notify()

    def close(self) -> None:
        for _ in self._readers:
            self.queue.put(None)
        for reader in self._readers:
            if not reader.retired and reader.thread is not None:
                reader.thread.join(5.0)
