"""The files of /v1/files, on disk under `<batch dir>/files`: each file's bytes (`<id>.data`) and
its OpenAI File object (`<id>.json`, written after the bytes, so that a file whose object exists
is whole). Batch input uploads and batch output / error files alike."""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write `obj` so that a reader (or a restart after a kill) sees the old or the new file whole."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def data_path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.data"

    def _meta_path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.json"

    def new_id(self) -> str:
        return f"file-{uuid.uuid4().hex}"

    def add(self, file_id: str, src: Path, filename: str, purpose: str) -> dict:
        """Take the finished file `src` (moved in) as `file_id`; returns its File object."""
        shutil.move(src, self.data_path(file_id))
        return self._describe(file_id, filename, purpose)

    def write(self, file_id: str, data: bytes, filename: str, purpose: str) -> dict:
        """`data` as the file `file_id` (written again whole if it exists)."""
        tmp = self.root / f"{file_id}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.data_path(file_id))
        return self._describe(file_id, filename, purpose)

    def _describe(self, file_id: str, filename: str, purpose: str) -> dict:
        meta = {
            "id": file_id,
            "object": "file",
            "bytes": self.data_path(file_id).stat().st_size,
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": None,
        }
        write_json_atomic(self._meta_path(file_id), meta)
        return meta

    def get(self, file_id: str) -> dict | None:
        if not _safe_id(file_id):
            return None
        try:
            return json.loads(self._meta_path(file_id).read_text())
        except (OSError, ValueError):
            return None

    def list(self, purpose: str | None = None) -> list[dict]:
        files = [self.get(p.stem) for p in self.root.glob("file-*.json")]
        files = [f for f in files if f is not None and (purpose is None or f["purpose"] == purpose)]
        return sorted(files, key=lambda f: (f["created_at"], f["id"]), reverse=True)

    def delete(self, file_id: str) -> bool:
        if self.get(file_id) is None:
            return False
        self._meta_path(file_id).unlink()
        self.data_path(file_id).unlink(missing_ok=True)
        return True


def _safe_id(file_id: str) -> bool:
    """An id names a file in the folder, never a path out of it."""
    return file_id.startswith("file-") and file_id.replace("-", "").isalnum()
