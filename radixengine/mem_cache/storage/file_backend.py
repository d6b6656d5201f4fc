"""HiCacheFile: one file per storage page (SGLang's `file` backend).

Layout: `<dir>/<identity tag>/<page key>.kv`, so that engines of different models, dtypes, page
sizes or layer counts on one folder never meet. A file is a magic line, a JSON header (the
identity, the key, the page's token ids, the payload's shape, dtype, length and CRC-32) and the
payload. It is written to a temporary name in the same folder and renamed into place, so a
reader sees a whole file or none; a temporary file left by a killed writer is never read, and
removed at the next start once it is old. Every read checks the header and the checksum: a file
that fails is named in a warning, deleted and reported missing (its tokens are recomputed).
An unwritable or full folder turns writes off with one warning; reads go on.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
import uuid
import zlib
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


class HiCacheFile:
    def __init__(self, root: str | os.PathLike, identity: KVIdentity, max_bytes: int = 0) -> None:
        self.identity = identity
        self.root = Path(root)
        self.dir = self.root / identity.tag()
        self.max_bytes = max_bytes  # 0: no bound
        self.writable = True
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._identity_json = asdict(identity)
        self._total_bytes = 0
        self._open()

    # ---- set-up ----

    def _open(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe-{os.getpid()}-{uuid.uuid4().hex}{TMP_SUFFIX}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            self._disable_writes(e)
        self._remove_stale_tmp()
        self._total_bytes = self._scan_bytes()

    def _disable_writes(self, error: OSError) -> None:
        if self.writable:
            logger.warning(
                "hicache storage: cannot write to %s (%s); serving on without writing to storage",
                self.dir,
                error,
            )
        self.writable = False

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
        total = 0
        for path in self._list(SUFFIX):
            try:
                total += path.stat().st_size
            except OSError:
                pass
        return total

    def path_of(self, key: str) -> Path:
        return self.dir / f"{key}{SUFFIX}"

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
        try:
            os.utime(path)  # the size bound evicts the least recently used pages
        except OSError:
            pass
        return page

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
        at += header_len
        if header.get("identity") != self._identity_json:
            return None, f"written by another model or layout ({header.get('identity')})"
        if header.get("key") != key or tuple(header.get("tokens", ())) != tuple(tokens):
            return None, "holds another prefix than its name says"
        payload = data[at:]
        if len(payload) != header.get("payload_bytes"):
            return None, f"truncated payload ({len(payload)} of {header.get('payload_bytes')} bytes)"
        if zlib.crc32(payload) != header.get("crc32"):
            return None, "checksum mismatch (corrupt payload)"
        dtype = getattr(torch, str(header.get("dtype")), None)
        shape = tuple(header.get("shape", ()))
        if not isinstance(dtype, torch.dtype) or shape != self.identity.page_shape():
            return None, "unexpected payload shape or dtype"
        page = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(shape)
        return page, None

    def _warn_bad(self, path: Path, problem: str, delete: bool) -> None:
        if delete:
            try:
                path.unlink()
            except OSError:
                pass
        name = str(path)
        if name not in self._warned:
            self._warned.add(name)
            logger.warning("hicache storage: ignoring %s: %s; its tokens are recomputed", name, problem)

    # ---- writes ----

    def set(self, key: str, tokens: tuple[int, ...], page: torch.Tensor) -> bool:
        if not self.writable:
            return False
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
        blob = MAGIC + struct.pack("<I", len(header)) + header + payload
        tmp = self.dir / f".{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}{TMP_SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, self.path_of(key))
        except OSError as e:
            _unlink_quietly(tmp)
            self._disable_writes(e)
            return False
        self._account(len(blob))
        return True

    def _account(self, nbytes: int) -> None:
        with self._lock:
            self._total_bytes += nbytes
            over = self.max_bytes and self._total_bytes > self.max_bytes
        if over:
            self.evict_to(int(self.max_bytes * EVICT_TO))

    def evict_to(self, target_bytes: int) -> int:
        """Delete the least recently used pages until the folder holds at most `target_bytes`
        (counted afresh: other engines may write to it too). Returns how many were deleted."""
        files = []
        for path in self._list(SUFFIX):
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
            _unlink_quietly(path)
            total -= size
            deleted += 1
        with self._lock:
            self._total_bytes = total
        return deleted

    def total_bytes(self) -> int:
        return self._total_bytes


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
