"""The storage writer's shutdown (mem_cache/storage/io_threads.py): `close` writes what is
queued, but for at most its time limit, so that a stopping server neither drops queued pages
nor hangs on a disk that does not keep up."""

from __future__ import annotations

import logging
import threading

import torch

from radixengine.mem_cache.storage.base import KVIdentity, page_keys
from radixengine.mem_cache.storage.file_backend import HiCacheFile
from radixengine.mem_cache.storage.io_threads import StorageWriter

IDENTITY = KVIdentity("m", "float32", 4, 1, 1, 2)
TOKENS = tuple(range(12))


def pages(n: int):
    keys = page_keys(TOKENS, 4, n)
    return [
        (keys[k], TOKENS[4 * k : 4 * k + 4], torch.full(IDENTITY.page_shape(), float(k))) for k in range(n)
    ]


class GatedStorage:
    """A backend whose writes wait for `gate`: a disk that does not keep up."""

    identity = IDENTITY

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.written: list[str] = []

    def set(self, key: str, tokens: tuple[int, ...], page: torch.Tensor) -> bool:
        self.gate.wait()
        self.written.append(key)
        return True

    def get(self, key: str, tokens: tuple[int, ...]) -> torch.Tensor | None:
        return None

    def exists(self, key: str) -> bool:
        return False

    def touch(self, key: str) -> bool:
        return key in self.written

    def take_removed(self) -> list[str]:
        return []

    def discard(self, key: str, problem: str) -> None:
        pass

    def describe(self, key: str) -> str:
        return key


def test_close_writes_every_queued_page(tmp_path):
    storage = HiCacheFile(tmp_path, IDENTITY)
    writer = StorageWriter(storage)
    for page in pages(3):
        assert writer.submit(*page)
    writer.close(30.0)
    assert len(list(tmp_path.glob("*/*.kv"))) == 3 and writer.written == 3 and writer.queued() == 0


def test_close_gives_up_after_its_time_limit_and_names_the_loss(caplog):
    storage = GatedStorage()
    writer = StorageWriter(storage)
    for page in pages(3):
        writer.submit(*page)
    with caplog.at_level(logging.WARNING, "radixengine.mem_cache.storage.io_threads"):
        writer.close(0.05)  # returns although no page can be written
    assert "3 pages not written" in caplog.text and storage.written == []
    storage.gate.set()
    writer.thread.join(30.0)
    assert not writer.thread.is_alive()


def test_flush_reports_whether_the_queue_drained():
    storage = GatedStorage()
    writer = StorageWriter(storage)
    writer.submit(*pages(1)[0])
    assert writer.flush(0.01) is False and writer.queued() == 1
    storage.gate.set()
    assert writer.flush(None) is True and writer.queued() == 0
    writer.close(1.0)
