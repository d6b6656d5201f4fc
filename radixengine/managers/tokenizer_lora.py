"""The front end's LoRA adapters (docs/lora.md): a request's adapter name resolved to its id (an
unknown one is a 400 naming it), the requests in flight per adapter, and loading / unloading at
run time. Unloading stops new requests of the adapter at once, waits for those in flight, then
has the worker drop it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from radixengine.lora.lora_registry import LoRARef, LoRARegistry, UnknownLoRAError, parse_lora_paths
from radixengine.managers.io_struct import (
    LoadLoRAAdapterReqInput,
    LoRAAdapterReqOutput,
    UnloadLoRAAdapterReqInput,
)
from radixengine.managers.request_errors import RequestError

RequestReply = Callable[[object, type], Awaitable[object]]


class LoRAServerArgs(Protocol):
    enable_lora: bool
    lora_paths: list[str] | None


class TokenizerLoRA:
    def __init__(self, args: LoRAServerArgs, request_reply: RequestReply, served_model_name: str) -> None:
        """`served_model_name`: the base model's, which no adapter may take (a `model` naming it
        means the base model)."""
        self.enabled = args.enable_lora
        self.registry = LoRARegistry(parse_lora_paths(args.lora_paths) if self.enabled else [])
        if served_model_name in self.registry:
            raise ValueError(
                f"--lora-paths: an adapter is named {served_model_name!r}, as the served model is; rename it"
            )
        self.served_model_name = served_model_name
        self._request_reply = request_reply
        self._busy: set[str] = set()  # names being loaded or unloaded
        self._lock = asyncio.Lock()  # one load or unload on its way to the scheduler at a time

    def resolve(self, name: object, param: str = "lora_path") -> str | None:
        """The adapter id of a request's `lora_path` (None: the base model)."""
        if name is None:
            return None
        if not isinstance(name, str):
            raise RequestError(f"{param} must be an adapter name (a string), got {name!r}", param=param)
        if not self.enabled:
            raise RequestError(
                f"LoRA adapter {name!r} requested, but LoRA is not enabled (start with --enable-lora)",
                param=param,
            )
        try:
            return self.registry.resolve(name).lora_id
        except UnknownLoRAError as e:
            raise RequestError(str(e), param=param) from None

    def names(self) -> list[str]:
        return [r.lora_name for r in self.registry.refs()]

    def loaded(self) -> dict[str, str]:
        """The adapters loaded now, name → path (SGLang's `loaded_adapters`)."""
        return {r.lora_name: r.lora_path for r in self.registry.refs()}

    async def load(self, name: str, path: str, pinned: bool = False) -> LoRARef:
        self._check_enabled()
        if name in self.registry or name in self._busy:
            raise RequestError(f"a LoRA adapter named {name!r} is already loaded", param="lora_name")
        if name == self.served_model_name:
            raise RequestError(
                f"a LoRA adapter may not be named {name!r}, as the served model is", param="lora_name"
            )
        ref = LoRARef(name, path, pinned)
        self._busy.add(name)
        try:
            async with self._lock:
                reply = await self._request_reply(
                    LoadLoRAAdapterReqInput(ref.lora_id, name, path, pinned), LoRAAdapterReqOutput
                )
            if not reply.success:
                raise RequestError(
                    f"LoRA adapter {name!r} not loaded: {reply.error_message}", param="lora_path"
                )
            self.registry.register(ref)
        finally:
            self._busy.discard(name)
        return ref

    async def unload(self, name: str) -> LoRARef:
        self._check_enabled()
        try:
            ref = self.registry.unregister(name)
        except UnknownLoRAError as e:
            raise RequestError(str(e), param="lora_name") from None
        self._busy.add(name)
        try:
            await self.registry.wait_idle(ref.lora_id)
            async with self._lock:
                reply = await self._request_reply(
                    UnloadLoRAAdapterReqInput(ref.lora_id, name), LoRAAdapterReqOutput
                )
            if not reply.success:
                raise RequestError(f"LoRA adapter {name!r} not unloaded: {reply.error_message}", 500)
        finally:
            self._busy.discard(name)
        return ref

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise RequestError("LoRA is not enabled: start the server with --enable-lora")
