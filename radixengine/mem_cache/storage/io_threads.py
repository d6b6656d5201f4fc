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
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from radixengine.mem_cache.storage.base import HiCacheStorage

logger = logging.getLogger(__name__)

NEGATIVE_TTL_S = 5.0  # a prefetch that found nothing is not retried sooner (unless we write it)
MAX_PREFETCH_OPS = 256


class StorageWriter:
    def __init__(self, storage: HiCacheStorage, max_pending_bytes: int = 256 << 20) -> None:
        self.storage = storage
        self.queue: queue.Queue = queue.Queue()
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0  # of pages submitted and not written yet (the bound)
        self._lock = threading.Lock()
        self.written = 0
        self.dropped = 0
        self.failed = 0
        self.thread = threading.Thread(target=self._run, name="hicache-writer", daemon=True)
        self.thread.start()

    def submit(self, key: str, tokens: tuple[int, ...], page: torch.Tensor) -> bool:
        """Queue a page; False (dropped) if the pages waiting already hold the byte bound."""
        size = page.numel() * page.element_size()
        with self._lock:
            if self.pending_bytes + size > self.max_pending_bytes:
                self.dropped += 1
                return False
            self.pending_bytes += size
        self.queue.put((key, tokens, page))
        return True

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                ok = self.storage.set(*item)
                self.written += ok
                self.failed += not ok
            except Exception:  # a backend bug must not end the thread: the page is not stored
                logger.exception("hicache storage: writing a page failed")
                self.failed += 1
            finally:
                if item is not None:
                    with self._lock:
                        self.pending_bytes -= item[2].numel() * item[2].element_size()
                self.queue.task_done()

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
    keys: list[str]
    tokens: list[tuple[int, ...]]
    pages: list[torch.Tensor] = field(default_factory=list)  # found so far, in order
    done: threading.Event = field(default_factory=threading.Event)
    created: float = field(default_factory=time.monotonic)

    def wait(self, timeout: float | None) -> None:
        self.done.wait(timeout)


class StoragePrefetcher:
    def __init__(self, storage: HiCacheStorage) -> None:
        self.storage = storage
        self.queue: queue.Queue = queue.Queue()
        self._ops: OrderedDict[str, PrefetchOp] = OrderedDict()  # by first key; scheduler thread only
        self.thread = threading.Thread(target=self._run, name="hicache-prefetch", daemon=True)
        self.thread.start()

    def request(self, keys: list[str], tokens: list[tuple[int, ...]]) -> PrefetchOp:
        """The prefetch of `keys` (in order), started now unless one from the same page is
        running or fresh."""
        op = self._ops.get(keys[0])
        if op is not None and not self._stale(op, len(keys)):
            self._ops.move_to_end(keys[0])
            return op
        op = PrefetchOp(list(keys), list(tokens))
        self._ops[keys[0]] = op
        while len(self._ops) > MAX_PREFETCH_OPS:
            self._ops.popitem(last=False)
        self.queue.put(op)
        return op

    @staticmethod
    def _stale(op: PrefetchOp, num_keys: int) -> bool:
        if not op.done.is_set():
            return False
        if len(op.pages) < len(op.keys):  # it stopped at a missing page: retry after a while
            return time.monotonic() - op.created > NEGATIVE_TTL_S
        return num_keys > len(op.keys)

    def forget(self, key: str) -> None:
        """`key` was just written: a prefetch that found it missing is out of date."""
        op = self._ops.get(key)
        if op is not None and op.done.is_set() and not op.pages:
            del self._ops[key]

    def discard(self, op: PrefetchOp) -> None:
        """Its pages are in the pool now: let the host copies go."""
        if self._ops.get(op.keys[0]) is op:
            del self._ops[op.keys[0]]

    def _run(self) -> None:
        while True:
            op = self.queue.get()
            if op is None:
                return
            try:
                for key, tokens in zip(op.keys, op.tokens):
                    page = self.storage.get(key, tokens)
                    if page is None:
                        break
                    op.pages.append(page)
            except Exception:
                logger.exception("hicache storage: prefetch failed")
            finally:
                op.done.set()

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(5.0)
