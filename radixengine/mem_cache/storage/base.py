"""What the storage tier stores and how its pages are named.

A storage page holds the KV of `page_tokens` consecutive tokens of a prefix, for every layer:
a tensor `[layer_num, 2 (K, V), page_tokens, head_num, head_dim]`. Its key is a hash chain, as
SGLang's storage keys: the key of page k hashes the key of page k-1 with page k's token ids, so
a key names the whole prefix up to the end of its page and nothing else. The chain of a radix
namespace (a LoRA adapter's KV) starts from that namespace's seed (storage/namespaces.py)
instead of nothing, so its pages never meet another namespace's or the base model's.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from dataclasses import asdict, dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class KVIdentity:
    """What KV bytes depend on besides the tokens: a page is used only under the same identity."""

    model: str  # the model (path and revision), its weight dtype and quantization
    kv_dtype: str
    page_tokens: int
    layer_num: int
    head_num: int
    head_dim: int

    def tag(self) -> str:
        """A short name for the identity (the storage folder's subfolder)."""
        text = "|".join(f"{k}={v}" for k, v in sorted(asdict(self).items()))
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def page_shape(self) -> tuple[int, ...]:
        return (self.layer_num, 2, self.page_tokens, self.head_num, self.head_dim)

    def page_bytes(self) -> int:
        return math.prod(self.page_shape()) * getattr(torch, self.kv_dtype).itemsize


def page_keys(tokens: tuple[int, ...], page_tokens: int, num_pages: int, seed: bytes = b"") -> list[str]:
    """The keys of the first `num_pages` whole pages of `tokens` (a hash chain starting from
    `seed`: nothing for the base model, `namespace_seed` for a namespace)."""
    keys: list[str] = []
    prev = seed
    for k in range(num_pages):
        chunk = array("q", tokens[k * page_tokens : (k + 1) * page_tokens]).tobytes()
        prev = hashlib.blake2b(prev + chunk, digest_size=16).digest()
        keys.append(prev.hex())
    return keys


class HiCacheStorage(Protocol):
    """A storage backend (SGLang's HiCacheStorage, reduced to what the cache uses). Every method
    may be called from a background thread; none raises for a missing or bad page."""

    identity: KVIdentity
    max_bytes: int  # the size bound; 0: none

    def get(self, key: str, tokens: tuple[int, ...]) -> torch.Tensor | None:
        """The page stored under `key` if it is there, whole and of this identity and these
        tokens; None otherwise (a bad file is named in a warning and not used)."""

    def set(self, key: str, tokens: tuple[int, ...], page: torch.Tensor) -> bool:
        """Store a page; False if it could not be (it may be stored again later)."""

    def exists(self, key: str) -> bool: ...

    def touch(self, key: str) -> bool:
        """Mark the page of `key` used now (the size bound deletes the least recently used);
        False if storage does not have it."""

    def take_removed(self) -> list[str]:
        """Keys whose pages were deleted (size bound, bad files) since the last call."""

    def discard(self, key: str, problem: str) -> None:
        """The page of `key` cannot be used: name it and `problem` in a warning, delete it."""

    def describe(self, key: str) -> str:
        """Where the page of `key` is, or with "" where the pages are (for messages)."""

    def clear(self) -> int:
        """Delete every page of this identity; returns how many."""

    def total_bytes(self) -> int:
        """Bytes the pages take (the size bound's count)."""
