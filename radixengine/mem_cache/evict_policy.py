"""Which unlocked leaf of the radix tree is evicted first (SGLang's `--radix-eviction-policy`).

Each strategy maps a node to a sort key; the smallest key is evicted first. Every key here only
grows while the node lives (access times tick up, hit counts and priorities only rise), which is
what lets RadixCache keep one lazy heap: a stale entry pops early and is pushed again.
"""

from __future__ import annotations

from typing import Protocol

RADIX_EVICTION_POLICIES = ("lru", "lfu", "slru", "priority")


# A node's sort key: the smallest is evicted first.
EvictionKey = int | tuple[int, ...]


class EvictionStats(Protocol):
    """What the strategies read of a tree node (RadixCache's TreeNode)."""

    last_access_time: int
    hit_count: int
    priority: int


class EvictionStrategy(Protocol):
    def get_priority(self, node: EvictionStats) -> EvictionKey: ...


class LRUStrategy:
    """Least recently used first."""

    def get_priority(self, node: EvictionStats) -> int:
        return node.last_access_time


class LFUStrategy:
    """Fewest requests that inserted through the node first; the least recently used among
    equals."""

    def get_priority(self, node: EvictionStats) -> tuple[int, int]:
        return (node.hit_count, node.last_access_time)


class SLRUStrategy:
    """Segmented LRU: nodes fewer than `protected_threshold` requests inserted (probationary) go
    before the protected ones; LRU within a segment."""

    def __init__(self, protected_threshold: int = 2) -> None:
        self.protected_threshold = protected_threshold

    def get_priority(self, node: EvictionStats) -> tuple[int, int]:
        return (int(node.hit_count >= self.protected_threshold), node.last_access_time)


class PriorityStrategy:
    """Prefixes of low-priority requests first (a node keeps the highest priority of the requests
    that inserted it); LRU among equals."""

    def get_priority(self, node: EvictionStats) -> tuple[int, int]:
        return (node.priority, node.last_access_time)


def get_eviction_strategy(policy: str) -> EvictionStrategy:
    strategies = {
        "lru": LRUStrategy,
        "lfu": LFUStrategy,
        "slru": SLRUStrategy,
        "priority": PriorityStrategy,
    }
    if policy not in strategies:
        raise ValueError(
            f"unknown radix eviction policy {policy!r}; one of {', '.join(RADIX_EVICTION_POLICIES)}"
        )
    return strategies[policy]()
