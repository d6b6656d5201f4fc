"""Where the storage page key chain of a radix namespace (SGLang's extra_key: a LoRA adapter's
`lora_id`) starts."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable


def namespace_seed(extra_key: str | None, salt: bytes, digest: bytes | None = None) -> bytes:
    """Where the page key chain of the radix namespace `extra_key` starts: nothing for the base
    model (None: its keys are those of every earlier version, so its files stay valid), else 16
    bytes as every chain link (no base chain can equal it).

    The namespace is a LoRA adapter's `lora_id`, which names one load of an adapter in one
    server, not its weights (`--lora-paths` ids are `init-<i>-<name>` at every start, whatever
    the path holds then). So the seed is the `digest` of the adapter's weights when the cache
    knows it (LoRAAdapter.digest): equal weights give equal KV, so the pages are reused after a
    restart or a reload and by another load of the same weights. Without one, the id salted with
    bytes of the cache's own start: reused while the server runs, never after a restart, when the
    same id may name other weights (the old pages leave by the size bound like any unused page)."""
    if extra_key is None:
        return b""
    if digest is not None:
        return hashlib.blake2b(b"weights|" + digest, digest_size=16).digest()
    return hashlib.blake2b(b"namespace|" + salt + extra_key.encode(), digest_size=16).digest()


class NamespaceSeeds:
    """The seed of each namespace a cache meets, from the digests `set_digests` resolves."""

    def __init__(self) -> None:
        self.salt = os.urandom(16)  # this start's
        self._digest_of: Callable[[str], bytes | None] = lambda extra_key: None
        self._seeds: dict[str, bytes] = {}

    def set_digests(self, digest_of: Callable[[str], bytes | None]) -> None:
        self._digest_of = digest_of
        self._seeds.clear()

    def seed(self, extra_key: str | None) -> bytes:
        if extra_key is None:
            return b""
        seed = self._seeds.get(extra_key)
        if seed is None:  # in one process an id names one load of one adapter
            seed = namespace_seed(extra_key, self.salt, self._digest_of(extra_key))
            self._seeds[extra_key] = seed
        return seed
