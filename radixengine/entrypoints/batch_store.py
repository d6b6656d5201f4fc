"""The batches of /v1/batches, on disk under `<batch dir>/batches`: each Batch object
(`<id>.json`, replaced whole on every change) and its result logs (`<id>.output.jsonl`,
`<id>.error.jsonl`, `<id>.invalid.jsonl`), appended one whole line at a time and flushed, so that
a server killed mid-batch knows on restart exactly which lines are answered."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from radixengine.entrypoints.file_store import write_json_atomic
from radixengine.utils.jsonl import numbered_lines
from radixengine.utils.unicode_check import dumps_json_text

TERMINAL = ("completed", "failed", "cancelled", "expired")


def default_batch_dir() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "radixengine", "batches")


def public(batch: dict) -> dict:
    """The Batch object as the API shows it (without the runner's own `_` keys)."""
    return {k: v for k, v in batch.items() if not k.startswith("_")}


class BatchStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._lock_file = None

    def lock(self) -> bool:
        """Hold the folder for this process (released when it exits, even killed); False when
        another process holds it."""
        f = open(self.root / "lock", "w")  # noqa: SIM115 (held for the process's life)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            return False
        self._lock_file = f
        return True

    def log_path(self, batch_id: str, kind: str) -> Path:
        return self.root / f"{batch_id}.{kind}.jsonl"

    def save(self, batch: dict) -> None:
        write_json_atomic(self.root / f"{batch['id']}.json", batch)

    def get(self, batch_id: str) -> dict | None:
        if not (batch_id.startswith("batch_") and batch_id[6:].isalnum()):
            return None
        try:
            return json.loads((self.root / f"{batch_id}.json").read_text())
        except (OSError, ValueError):
            return None

    def list(self) -> list[dict]:
        batches = [self.get(p.stem) for p in self.root.glob("batch_*.json")]
        return sorted((b for b in batches if b), key=lambda b: (b["created_at"], b["id"]), reverse=True)


class ResultLog:
    """One result log of a batch: the custom_ids already in it, and appends of whole lines. A
    line cut short by a kill (no newline) is dropped when the log is opened again."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.custom_ids: set = set()
        self.count = 0
        if path.exists():
            self._recover()
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the batch's run)

    def _recover(self) -> None:
        data = self.path.read_bytes()
        whole = data[: data.rfind(b"\n") + 1]
        if len(whole) != len(data):
            with open(self.path, "r+b") as f:
                f.truncate(len(whole))
        for n, line in numbered_lines(whole.split(b"\n")):
            try:
                self.custom_ids.add(json.loads(line)["custom_id"])
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(
                    f"{self.path.name} line {n} is not a result line ({type(e).__name__}: {e})"
                ) from None
            self.count += 1

    def append(self, record: dict) -> None:
        self._file.write(dumps_json_text(record) + "\n")
        self._file.flush()
        self.custom_ids.add(record["custom_id"])
        self.count += 1

    def reset(self) -> None:
        self._file.truncate(0)
        self.custom_ids.clear()
        self.count = 0

    def close(self) -> None:
        self._file.close()
