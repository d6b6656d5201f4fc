"""The token-accounting invariant, checked when no request is running:
`available + evictable + protected == size`, and every req_to_token row is free."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixengine.mem_cache.allocator import BaseTokenToKVPoolAllocator
    from radixengine.mem_cache.base_prefix_cache import BasePrefixCache
    from radixengine.mem_cache.memory_pool import ReqToTokenPool


class TokenAccountingError(AssertionError):
    """KV slots or req_to_token rows leaked (or were counted twice)."""


def token_accounting_message(
    allocator: BaseTokenToKVPoolAllocator,
    tree_cache: BasePrefixCache | None,
    req_to_token_pool: ReqToTokenPool | None = None,
) -> str | None:
    """What is wrong with the accounting, or None when it holds. `tree_cache` and
    `req_to_token_pool` may be None."""
    available = allocator.available_size()
    evictable = tree_cache.evictable_size() if tree_cache is not None else 0
    protected = tree_cache.protected_size() if tree_cache is not None else 0
    problems = []
    counted = available + evictable + protected
    if counted != allocator.size:
        difference = counted - allocator.size
        what = "counted twice" if difference > 0 else "leaked"
        problems.append(
            f"KV slots: available {available} + evictable {evictable} + protected {protected} = {counted} "
            f"!= size {allocator.size} (difference {difference:+d}: {abs(difference)} tokens {what})"
        )
    tier_problem = tree_cache.tier_accounting_problem() if tree_cache is not None else None
    if tier_problem is not None:
        problems.append(tier_problem)
    if req_to_token_pool is not None and req_to_token_pool.available_size() != req_to_token_pool.size:
        used = _used_rows(req_to_token_pool)
        problems.append(
            f"req_to_token rows still in use: {len(used)} of {req_to_token_pool.size}: {used[:16]}"
        )
    return "; ".join(problems) if problems else None


def check_token_accounting(
    allocator: BaseTokenToKVPoolAllocator,
    tree_cache: BasePrefixCache | None,
    req_to_token_pool: ReqToTokenPool | None = None,
) -> None:
    """Raise TokenAccountingError naming the difference unless the invariant holds."""
    message = token_accounting_message(allocator, tree_cache, req_to_token_pool)
    if message is not None:
        raise TokenAccountingError(f"token accounting broken: {message}")


def _used_rows(req_to_token_pool: ReqToTokenPool) -> list[int]:
    if hasattr(req_to_token_pool, "used_rows"):
        return req_to_token_pool.used_rows()
    free = set(req_to_token_pool.free_slots)
    return [row for row in range(req_to_token_pool.size) if row not in free]
