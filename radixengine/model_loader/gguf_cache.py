"""The folder that caches converted GGUF files: where it is, what a file's key is made of, the
lock one conversion holds, and the removal of what a killed conversion left behind.

A file's key comes from the SHA-256 of its whole content. Reading a multi-gigabyte file takes
seconds, so the digest is computed once per version of the file and remembered under
`digests/`, beside the file's stamp (device, inode, size, mtime, ctime): a file replaced or
rewritten gets a new stamp and is read again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

KEY_CHARS = 32
DIGESTS = "digests"
_READ_CHUNK = 1 << 20
# `<key>.<suffix>` folders are conversions in progress (or killed); `<key>.lock` is their lock.
_TEMP_DIR = re.compile(rf"([0-9a-f]{{{KEY_CHARS}}})\.(?!lock$).+")


def cache_root() -> Path:
    return Path(os.environ.get("RADIXENGINE_CACHE_DIR") or Path.home() / ".cache" / "radixengine")


@dataclass(frozen=True)
class FileStamp:
    """One version of a file, told apart without reading it."""

    path: str
    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: str | os.PathLike) -> FileStamp:
        st = os.stat(path)
        real = os.path.realpath(path)
        return cls(real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def content_digest(path: str | os.PathLike) -> str:
    """SHA-256 (hex) of the whole file, read once per version of the file."""
    stamp = FileStamp.of(path)
    record = cache_root() / DIGESTS / f"{_short_hash(stamp.path)}.json"
    known = _read_record(record)
    if known is not None and known.get("stamp") == asdict(stamp):
        return str(known["sha256"])
    digest = _sha256_of_file(path)
    if FileStamp.of(path) != stamp:
        raise RuntimeError(f"{path} changed while it was being read; load it again once it is complete")
    _write_record(record, {"stamp": asdict(stamp), "sha256": digest})
    return digest


def cache_key(*parts: str) -> str:
    return _short_hash("|".join(parts))


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:KEY_CHARS]


def _sha256_of_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    buffer = memoryview(bytearray(_READ_CHUNK))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            h.update(buffer[:n])
    return h.hexdigest()


def _read_record(record: Path) -> dict | None:
    try:
        return json.loads(record.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("ignoring unreadable digest record %s: %s", record, e)
        return None


def _write_record(record: Path, value: dict) -> None:
    record.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=record.name + ".", dir=record.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(value, f)
    os.replace(tmp, record)


def lock_path(target: Path) -> Path:
    return target.with_name(target.name + ".lock")


def temp_dir_for(target: Path) -> Path:
    """A fresh folder beside `target` to convert into (hold `target`'s lock)."""
    return Path(tempfile.mkdtemp(prefix=f"{target.name}.tmp-", dir=target.parent))


@contextlib.contextmanager
def exclusive_lock(path: Path, blocking: bool = True) -> Iterator[bool]:
    """Holds an exclusive `flock` on `path` (created if missing); yields whether it got it (always
    True when blocking). The kernel releases it when the holder dies, however it dies."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def remove_stale_temp_dirs(root: Path) -> list[Path]:
    """Remove the folders of conversions that no process is running any more (killed before they
    could clean up): a conversion holds its key's lock for as long as its folder exists."""
    removed = []
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        match = _TEMP_DIR.fullmatch(entry.name)
        if match is None or not entry.is_dir():
            continue
        with exclusive_lock(root / f"{match.group(1)}.lock", blocking=False) as held:
            if held and entry.is_dir():
                logger.warning("removing %s, left by a conversion that did not finish", entry)
                shutil.rmtree(entry)
                removed.append(entry)
    return removed
