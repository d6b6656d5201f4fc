"""HiCacheFile: one file per storage page (SGLang's `file` backend).

Layout: `<dir>/<identity tag>/<page key>.kv`, so that engines of different models, dtypes, page
sizes or layer counts on one folder never meet. A file is a magic line, a JSON header (the
identity, the key, the page's token ids, the payload's shape, dtype, length and CRC-32) and the
payload. It is written to a temporary name in the same folder and renamed into place, so a
reader sees a whole file or none; a temporary file left by a killed writer is never read, and
removed at the next start once it is old. Every read checks the header and the checksum: a file
that fails is named in a warning, deleted and reported missing (its tokens are recomputed).
A page that cannot be written (an unwritable folder, a full disk) is skipped and written again
the next time a request goes through it; a full disk first makes room by deleting the least
recently used pages. Failures are logged once per `WRITE_WARNING_INTERVAL_S`; reads go on.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
import struct
import threading
import time
import uuid
import zlib
from collections import deque
from dataclasses import asdict
from pathlib import Path

import torch

from radixengine.mem_cache.storage.base import KVIdentity

logger = logging.getLogger(__name__)

MAGIC = b"RADIXENGINE-KV-1\n"
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
STALE_TMP_S = 600.0  # a temporary file this old belongs to a writer that died
EVICT_TO = 0.9  # the size bound's eviction frees down to this fraction of it
RESCAN_S = 30.0  # how often a writer counts the whole folder again (others write to it too)
WRITE_WARNING_INTERVAL_S = 300  # write failures are logged at most once in this long


class HiCacheFile:
    def __init__(self, root: str | os.PathLike, identity: KVIdentity, max_bytes: int = 0) -> None:
        self.identity = identity
        self.root = Path(root)
        self.dir = self.root / identity.tag()
        self.max_bytes = max_bytes  # 0: no bound
        self._write_warned_at = -WRITE_WARNING_INTERVAL_S
        self._removed: deque[str] = deque()  # keys of pages deleted, for the cache to forget
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._identity_json = asdict(identity)
        self._total_bytes = 0
        self._scanned_at = 0.0
        self._open()

    # ---- set-up ----

    def _open(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe-{os.getpid()}-{uuid.uuid4().hex}{TMP_SUFFIX}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            self._warn_write(self.dir, e)
        self._remove_stale_tmp()
        self._total_bytes = self._scan_bytes()

    def _warn_write(self, path: Path, error: OSError) -> None:
        """A write failed: the page is skipped (written again when a request next goes through
        it). One warning per `WRITE_WARNING_INTERVAL_S`."""
        now = time.monotonic()
        if now - self._write_warned_at < WRITE_WARNING_INTERVAL_S:
            return
        self._write_warned_at = now
        logger.warning(
            "hicache storage: cannot write %s (%s); its pages are skipped and written later "
            "(further failures in the next %d s are counted, not logged)",
            path,
            error,
            WRITE_WARNING_INTERVAL_S,
        )

    def _remove_stale_tmp(self) -> None:
        now = time.time()
        for path in self._list(TMP_SUFFIX):
            try:
                if now - path.stat().st_mtime > STALE_TMP_S:
                    path.unlink()
            except OSError:
                pass

    def _list(self, suffix: str) -> list[Path]:
        try:
            return [p for p in self.dir.iterdir() if p.name.endswith(suffix)]
        except OSError:
            return []

    def _scan_bytes(self) -> int:
        """Bytes of the pages in the whole folder (every identity's subfolder: the bound is the
        folder's)."""
        self._scanned_at = time.monotonic()
        total = 0
        for path in _pages_under(self.root):
            try:
                total += path.stat().st_size
            except OSError:
                pass
        return total

    def path_of(self, key: str) -> Path:
        return self.dir / f"{key}{SUFFIX}"

    def describe(self, key: str) -> str:
        return str(self.path_of(key) if key else self.dir)

    # ---- reads ----

    def exists(self, key: str) -> bool:
        return self.path_of(key).is_file()

    def get(self, key: str, tokens: tuple[int, ...]) -> torch.Tensor | None:
        path = self.path_of(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            self._warn_bad(path, f"unreadable ({e})", delete=False)
            return None
        page, problem = self._decode(data, key, tokens)
        if problem is not None:
            self._warn_bad(path, problem, delete=True)
            return None
        self.touch(key)
        return page

    def touch(self, key: str) -> bool:
        path = self.path_of(key)
        if not path.is_file():
            return False
        try:
            os.utime(path)  # the size bound evicts the least recently used pages
            return True
        except OSError:
            return False

    def take_removed(self) -> list[str]:
        keys = []
        while self._removed:
            keys.append(self._removed.popleft())
        return keys

    def _decode(
        self, data: bytes, key: str, tokens: tuple[int, ...]
    ) -> tuple[torch.Tensor | None, str | None]:
        if not data.startswith(MAGIC):
            return None, "not a KV page file (bad magic)"
        at = len(MAGIC)
        if len(data) < at + 4:
            return None, "truncated header"
        (header_len,) = struct.unpack_from("<I", data, at)
        at += 4
        try:
            header = json.loads(data[at : at + header_len])
        except (ValueError, UnicodeDecodeError):
            return None, "truncated or corrupt header"
        if not isinstance(header, dict):
            return None, f"header is not a JSON object ({type(header).__name__})"
        at += header_len
        if header.get("identity") != self._identity_json:
            return None, f"written by another model or layout ({header.get('identity')})"
        if header.get("key") != key or _as_tuple(header.get("tokens")) != tuple(tokens):
            return None, "holds another prefix than its name says"
        payload = data[at:]
        if len(payload) != header.get("payload_bytes"):
            return None, f"truncated payload ({len(payload)} of {header.get('payload_bytes')} bytes)"
        if zlib.crc32(payload) != header.get("crc32"):
            return None, "checksum mismatch (corrupt payload)"
        if header.get("dtype") != self.identity.kv_dtype:
            return None, f"payload dtype {header.get('dtype')!r}, not the KV dtype {self.identity.kv_dtype!r}"
        shape = _as_tuple(header.get("shape"))
        if shape != self.identity.page_shape():
            return None, f"payload shape {shape}, not the page shape {self.identity.page_shape()}"
        dtype = getattr(torch, self.identity.kv_dtype)
        if len(payload) != math.prod(shape) * dtype.itemsize:
            return None, "payload length does not match its shape"
        page = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(shape)
        return page, None

    def discard(self, key: str, problem: str) -> None:
        """The page of `key` cannot be used (`problem`): name it in a warning and delete it."""
        self._warn_bad(self.path_of(key), problem, delete=True)

    def _warn_bad(self, path: Path, problem: str, delete: bool) -> None:
        if delete:
            self._delete(path)
        name = str(path)
        if name not in self._warned:
            self._warned.add(name)
            logger.warning("hicache storage: ignoring %s: %s; its tokens are recomputed", name, problem)

    # ---- writes ----

    def set(self, key: str, tokens: tuple[int, ...], page: torch.Tensor) -> bool:
        """Write a page; False if it could not be (a full disk first makes room by deleting the
        least recently used pages, then tries once more)."""
        blob = self._encode(key, tokens, page)
        try:
            self._write(key, blob)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT) or not self._make_room(len(blob)):
                self._warn_write(self.path_of(key), e)
                return False
            try:
                self._write(key, blob)
            except OSError as again:
                self._warn_write(self.path_of(key), again)
                return False
        self._account(len(blob))
        return True

    def _encode(self, key: str, tokens: tuple[int, ...], page: torch.Tensor) -> bytes:
        payload = page.contiguous().view(torch.uint8).numpy().tobytes()
        header = json.dumps(
            {
                "identity": self._identity_json,
                "key": key,
                "tokens": list(tokens),
                "shape": list(page.shape),
                "dtype": str(page.dtype).removeprefix("torch."),
                "payload_bytes": len(payload),
                "crc32": zlib.crc32(payload),
            }
        ).encode()
        return MAGIC + struct.pack("<I", len(header)) + header + payload

    def _write(self, key: str, blob: bytes) -> None:
        """Write to a temporary name, then rename into place (a reader sees all or nothing)."""
        if not self.dir.is_dir():
            self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}{TMP_SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, self.path_of(key))
        except OSError:
            _unlink_quietly(tmp)
            raise

    def _make_room(self, nbytes: int) -> bool:
        """The disk is full: delete least recently used pages holding at least `nbytes`."""
        return self.evict_to(max(self._scan_bytes() - nbytes, 0)) > 0

    def _account(self, nbytes: int) -> None:
        """Count a page written; the folder is counted afresh every `RESCAN_S` (other engines'
        pages count against the bound too)."""
        if time.monotonic() - self._scanned_at >= RESCAN_S:
            total = self._scan_bytes()
            with self._lock:
                self._total_bytes = total
        else:
            with self._lock:
                self._total_bytes += nbytes
        if self.max_bytes and self._total_bytes > self.max_bytes:
            self.evict_to(int(self.max_bytes * EVICT_TO))

    def evict_to(self, target_bytes: int) -> int:
        """Delete the least recently used pages until the folder (all its subfolders) holds at
        most `target_bytes` (counted afresh: other engines may write to it too). Returns how
        many were deleted."""
        files = []
        for path in _pages_under(self.root):
            try:
                st = path.stat()
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, path))
        files.sort()
        total = sum(size for _, size, _ in files)
        deleted = 0
        for _, size, path in files:
            if total <= target_bytes:
                break
            self._delete(path)
            total -= size
            deleted += 1
        with self._lock:
            self._total_bytes = total
            self._scanned_at = time.monotonic()
        return deleted

    def _delete(self, path: Path) -> None:
        _unlink_quietly(path)
        if path.parent == self.dir:
            self._removed.append(path.stem)

    def clear(self) -> int:
        """Delete every page of this identity's subfolder; returns how many."""
        pages = self._list(SUFFIX)
        for path in pages:
            self._delete(path)
        self._total_bytes = self._scan_bytes()
        return len(pages)

    def free_disk_bytes(self) -> int | None:
        """Free bytes on the folder's disk; None if unknown."""
        try:
            return shutil.disk_usage(self.root).free
        except OSError:
            return None

    def total_bytes(self) -> int:
        """Bytes of the pages in the folder, as last counted (it counts the writes of this
        process; others' are seen at the next eviction)."""
        return self._total_bytes


def _pages_under(root: Path) -> list[Path]:
    """The page files of every identity's subfolder of `root`."""
    try:
        return [p for p in root.glob(f"*/*{SUFFIX}") if not p.name.startswith(".")]
    except OSError:
        return []


def _as_tuple(value: object) -> tuple | None:
    return tuple(value) if isinstance(value, list) else None


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
