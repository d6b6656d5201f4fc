"""The scheduler's view of the LoRA adapters (docs/lora.md): which ids the worker has loaded,
which are pinned, loading and unloading them on the worker, and the per-batch bound that
admission keeps (`--max-loras-per-batch` distinct adapters, pinned ones counted)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Protocol

from radixengine.lora.lora_registry import LoRARef, parse_lora_paths
from radixengine.managers.io_struct import (
    LoadLoRAAdapterReqInput,
    LoRAAdapterReqOutput,
    UnloadLoRAAdapterReqInput,
)

logger = logging.getLogger("radixengine.managers.scheduler")

LoRAMessage = LoadLoRAAdapterReqInput | UnloadLoRAAdapterReqInput


class LoRAWorker(Protocol):
    def load_lora_adapter(self, lora_id: str, lora_path: str, pinned: bool) -> None: ...

    def unload_lora_adapter(self, lora_id: str) -> None: ...

    def lora_adapter_digest(self, lora_id: str) -> bytes | None: ...


class LoRAAdapters:
    def __init__(
        self,
        worker: LoRAWorker | None,
        send: Callable[[object], None],
        max_loras_per_batch: int,
        initial: Iterable[LoRARef] = (),
    ) -> None:
        """`worker` None: LoRA is off (every adapter request is refused)."""
        self.worker = worker
        self.send = send
        self.max_loras_per_batch = max_loras_per_batch
        self.loaded: set[str] = set()
        self.pinned: set[str] = set()
        for ref in initial:
            self._add(ref.lora_id, ref.pinned)

    def _add(self, lora_id: str, pinned: bool) -> None:
        self.loaded.add(lora_id)
        if pinned:
            self.pinned.add(lora_id)

    def handle(self, msg: LoRAMessage) -> None:
        try:
            if self.worker is None:
                raise ValueError("LoRA is not enabled (start the server with --enable-lora)")
            if isinstance(msg, LoadLoRAAdapterReqInput):
                self.worker.load_lora_adapter(msg.lora_id, msg.lora_path, msg.pinned)
                self._add(msg.lora_id, msg.pinned)
            else:
                self.worker.unload_lora_adapter(msg.lora_id)
                self.loaded.discard(msg.lora_id)
                self.pinned.discard(msg.lora_id)
        except Exception as e:  # a bad adapter fails its request alone
            logger.warning("LoRA adapter %s: %s", msg.lora_name, e)
            self.send(
                LoRAAdapterReqOutput(
                    False, str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
                )
            )
            return
        self.send(LoRAAdapterReqOutput(True))

    def digest(self, lora_id: str) -> bytes | None:
        """The digest of the adapter's weights (the hierarchical cache's storage keys), if loaded."""
        return None if self.worker is None else self.worker.lora_adapter_digest(lora_id)

    def request_error(self, lora_id: str | None) -> str | None:
        if lora_id is None or lora_id in self.loaded:
            return None
        if self.worker is None:
            return "LoRA is not enabled: start the server with --enable-lora to use lora_path"
        return f"LoRA adapter id {lora_id} is not loaded"

    def fits(self, batch_lora_ids: Iterable[str | None], lora_id: str | None) -> bool:
        """Whether a request of `lora_id` can join a batch of these adapters."""
        if lora_id is None:
            return True
        used = {i for i in batch_lora_ids if i is not None} | self.pinned
        return len(used | {lora_id}) <= self.max_loras_per_batch


class LoRAArgs(Protocol):
    enable_lora: bool
    lora_paths: list[str] | None
    max_loras_per_batch: int


def make_lora_adapters(args: LoRAArgs, worker: object, send: Callable[[object], None]) -> LoRAAdapters:
    """The scheduler's component: with --enable-lora over the worker (its --lora-paths already
    loaded), else one that refuses every adapter."""
    if not args.enable_lora:
        return LoRAAdapters(None, send, args.max_loras_per_batch)
    return LoRAAdapters(worker, send, args.max_loras_per_batch, parse_lora_paths(args.lora_paths))
