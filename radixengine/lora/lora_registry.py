"""Adapter names (the front end's view): `--lora-paths` specs, `LoRARef` and the registry that
resolves a request's adapter name and counts its requests in flight (SGLang's LoRARegistry)."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoRARef:
    """One loaded adapter. `lora_id` is unique per load: an adapter unloaded and loaded again
    under the same name is another id (its KV is another radix namespace)."""

    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str = field(default_factory=lambda: uuid.uuid4().hex)


def parse_lora_path(spec: str) -> LoRARef:
    """`PATH`, `NAME=PATH` or JSON `{"lora_name", "lora_path", "pinned"}` (SGLang's forms)."""
    text = spec.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-paths: {spec!r} is not valid JSON: {e}") from None
        unknown = set(obj) - {"lora_name", "lora_path", "pinned"}
        if unknown or "lora_path" not in obj:
            raise ValueError(
                f"--lora-paths: {spec!r} must have lora_path (and may have lora_name, pinned); "
                f"unknown keys {sorted(unknown)}"
            )
        path = str(obj["lora_path"])
        return LoRARef(str(obj.get("lora_name") or path), path, bool(obj.get("pinned", False)))
    if "=" in text:
        name, path = text.split("=", 1)
        if not name or not path:
            raise ValueError(f"--lora-paths: {spec!r} must be PATH, NAME=PATH or JSON")
        return LoRARef(name, path)
    if not text:
        raise ValueError("--lora-paths: an empty entry")
    return LoRARef(text, text)


def parse_lora_paths(specs: list[str] | None) -> list[LoRARef]:
    """The adapters of `--lora-paths`; their ids are fixed by their place in the list, so the
    front end and the model worker, parsing the same flags, agree on them."""
    refs = [parse_lora_path(s) for s in specs or []]
    refs = [
        LoRARef(r.lora_name, r.lora_path, r.pinned, f"init-{i}-{r.lora_name}") for i, r in enumerate(refs)
    ]
    names = [r.lora_name for r in refs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"--lora-paths: adapter names {duplicates} appear more than once")
    return refs


class UnknownLoRAError(ValueError):
    """A request names an adapter that is not loaded (a 400)."""


class LoRARegistry:
    """name → LoRARef, and per adapter the requests in flight (the HTTP process's event loop)."""

    def __init__(self, refs: list[LoRARef] | None = None) -> None:
        self._refs: dict[str, LoRARef] = {r.lora_name: r for r in refs or []}
        self._unloaded: set[str] = set()  # names unloaded and not loaded again
        self._in_flight: dict[str, int] = {}
        self._idle: dict[str, asyncio.Event] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._refs

    def refs(self) -> list[LoRARef]:
        return list(self._refs.values())

    def was_unloaded(self, name: str) -> bool:
        return name in self._unloaded

    def resolve(self, name: str) -> LoRARef:
        ref = self._refs.get(name)
        if ref is None:
            known = ", ".join(sorted(self._refs)) or "none loaded"
            state = "was unloaded" if name in self._unloaded else "is not loaded"
            raise UnknownLoRAError(f"LoRA adapter {name!r} {state} (loaded: {known})")
        return ref

    def register(self, ref: LoRARef) -> None:
        if ref.lora_name in self._refs:
            raise ValueError(f"a LoRA adapter named {ref.lora_name!r} is already loaded")
        self._refs[ref.lora_name] = ref
        self._unloaded.discard(ref.lora_name)

    def unregister(self, name: str) -> LoRARef:
        """Stop resolving `name` (new requests get a 400); returns its ref."""
        ref = self.resolve(name)
        del self._refs[name]
        self._unloaded.add(name)
        return ref

    def acquire(self, lora_id: str) -> None:
        self._in_flight[lora_id] = self._in_flight.get(lora_id, 0) + 1

    def release(self, lora_id: str) -> None:
        left = self._in_flight.get(lora_id, 0) - 1
        if left > 0:
            self._in_flight[lora_id] = left
            return
        self._in_flight.pop(lora_id, None)
        event = self._idle.pop(lora_id, None)
        if event is not None:
            event.set()

    def in_flight(self, lora_id: str) -> int:
        return self._in_flight.get(lora_id, 0)

    async def wait_idle(self, lora_id: str) -> None:
        """Until no request of the adapter is in flight."""
        if not self._in_flight.get(lora_id):
            return
        event = self._idle.setdefault(lora_id, asyncio.Event())
        await event.wait()
