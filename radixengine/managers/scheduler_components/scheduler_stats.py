"""The scheduler's counters. Each component adds to its own through a method; only this file
writes them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    num_prefill_tokens: int = 0  # prompt tokens computed (KV written by a prefill)
    num_cached_tokens: int = 0  # prompt tokens served from the cache
    num_generated_tokens: int = 0
    num_retracted_reqs: int = 0
    num_preempted_reqs: int = 0
    num_forward_steps: int = 0
    # Speculative decoding: drafts verified (one per drafting request per verify step) and the
    # tokens their requests took from them (accepted drafts plus the bonus token).
    num_spec_verify_reqs: int = 0
    num_spec_verified_tokens: int = 0

    @property
    def cache_hit_rate(self) -> float:
        total = self.num_prefill_tokens + self.num_cached_tokens
        return self.num_cached_tokens / total if total else 0.0

    @property
    def avg_spec_accept_length(self) -> float:
        """Tokens a request takes from a verify step, on average (1.0: no draft accepted)."""
        return self.num_spec_verified_tokens / self.num_spec_verify_reqs if self.num_spec_verify_reqs else 0.0

    def add_spec_verify(self, tokens: int) -> None:
        self.num_spec_verify_reqs += 1
        self.num_spec_verified_tokens += tokens

    def add_prefill(self, computed_tokens: int, cached_tokens: int) -> None:
        self.num_prefill_tokens += computed_tokens
        self.num_cached_tokens += cached_tokens

    def add_generated(self, n: int = 1) -> None:
        self.num_generated_tokens += n

    def add_retracted(self, n: int) -> None:
        self.num_retracted_reqs += n

    def add_preempted(self, n: int) -> None:
        self.num_preempted_reqs += n

    def add_forward_step(self) -> None:
        self.num_forward_steps += 1
