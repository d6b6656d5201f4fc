"""Step recovery: an exception raised while a step is scheduled, prepared, run, sampled or processed
ends the requests of that step, not the scheduler process (SGLang's scheduler exits on any).

The step's requests are those of the batch whose phase raised (`enter` names it as the loop goes;
the requests a component was working on when it raised, `StepRequestsError`, a cache load during
admission; every admitted request where no batch is named yet). Each ends with a 500 naming the
failure. What a half-run step left in the pools is not known, so nothing of it is trusted: the
forward stream is drained, the launched results dropped, and the pools and the device radix cache
are emptied (as /flush_cache does). The other admitted requests are retracted, as decode
retraction does (their output kept, their KV recomputed when they are admitted again), so they
end with the tokens they would have had. The token-accounting invariant is then checked. A failure
with no request to end twice in a row (the same step would fail again), an accounting error, or an
exception while recovering raises `UncontainedStepError`: the process exits and the server starts
a new scheduler."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from radixengine.managers.schedule_batch import Req
from radixengine.managers.scheduler_components.output_streamer import OutputStreamer
from radixengine.managers.scheduler_components.request_intake import RequestIntake
from radixengine.mem_cache.accounting import TokenAccountingError, check_token_accounting
from radixengine.mem_cache.allocator import BaseTokenToKVPoolAllocator
from radixengine.mem_cache.base_prefix_cache import BasePrefixCache
from radixengine.mem_cache.memory_pool import ReqToTokenPool
from radixengine.utils.streams import StreamError

logger = logging.getLogger("radixengine.managers.scheduler")


class StepRequestsError(Exception):
    """Raised around work on particular requests that are not admitted yet: they belong to the
    failed step too."""

    def __init__(self, reqs: list[Req], cause: Exception) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.reqs = reqs
        self.cause = cause


class UncontainedStepError(RuntimeError):
    """The scheduler cannot show that its state is consistent after a failed step: it exits."""


class Quiescable(Protocol):
    def quiesce(self) -> None:
        """Wait for the work launched on the forward stream to end; forget its error."""
        ...


class Resettable(Protocol):
    def reset(self) -> None: ...


@dataclass(frozen=True)
class RecoveryPools:
    tree_cache: BasePrefixCache
    allocator: BaseTokenToKVPoolAllocator
    req_to_token_pool: ReqToTokenPool
    drafter: Resettable | None

    def reset(self) -> None:
        """Empty the device cache and the pools (nothing may hold KV or a row then)."""
        self.tree_cache.reset()
        if self.drafter is not None:
            self.drafter.reset()
        self.req_to_token_pool.clear()
        self.allocator.clear()

    def check(self) -> None:
        check_token_accounting(self.allocator, self.tree_cache, self.req_to_token_pool)


def failure_message(error: Exception) -> str:
    cause = error.cause if isinstance(error, StepRequestsError) else error
    while isinstance(cause, StreamError) and isinstance(cause.__cause__, Exception):
        cause = cause.__cause__  # what failed on the forward stream
    return (
        f"The scheduler failed while running this request's batch ({type(cause).__name__}: {cause}); "
        "the requests of that batch were ended and the server goes on serving."
    )


def admitted_requests(unanswered: Iterable[Req], queued: Iterable[Req], blamed: list[Req]) -> list[Req]:
    """Every unfinished request not in a queue (the waiting queue, the grammar queue), and the
    blamed ones."""
    waiting = {id(r) for r in queued}
    named = {id(r) for r in blamed}
    return [r for r in unanswered if not r.finished() and (id(r) in named or id(r) not in waiting)]


def split_step_requests(
    admitted: list[Req], blamed: list[Req], step_batch: list[Req] | None
) -> tuple[list[Req], list[Req]]:
    """(the requests the failed step ends, the admitted ones it retracts): the blamed ones if a
    component named them, else the requests of the batch whose phase raised, else all."""
    chosen = blamed or step_batch
    if chosen is None:
        return admitted, []
    ends = {id(r) for r in chosen}
    return [r for r in admitted if id(r) in ends], [r for r in admitted if id(r) not in ends]


class StepRecovery:
    def __init__(
        self,
        pools: RecoveryPools,
        worker: Quiescable,
        intake: RequestIntake,
        streamer: OutputStreamer,
        drop_launched: Callable[[], None],
    ) -> None:
        self.pools = pools
        self.worker = worker
        self.intake = intake
        self.streamer = streamer
        self.drop_launched = drop_launched  # the launched batches whose results are not processed
        self.contained = 0  # failed steps contained
        self.last_empty_failure: int | None = None  # the step of the last one that ended nothing
        self.step_batch: list[Req] | None = None  # the requests of the batch whose phase runs

    def enter(self, reqs: list[Req] | None) -> None:
        """The loop reaches a phase of the batch of `reqs` (None: no batch is known yet)."""
        self.step_batch = reqs

    def contain(self, error: Exception, step: int) -> list[Req]:
        """End the failed step's requests and empty the pools; returns the requests ended.
        Raises `UncontainedStepError` (or the accounting error) when that is not safe."""
        if isinstance(error, TokenAccountingError):
            raise error
        blamed = error.reqs if isinstance(error, StepRequestsError) else []
        queued = [*self.intake.waiting_queue, *self.intake.grammar_manager.grammar_queue]
        admitted = admitted_requests(self.streamer.unanswered.values(), queued, blamed)
        failed, retracted = split_step_requests(admitted, blamed, self.step_batch)
        if not failed:
            if self.last_empty_failure == step - 1:
                raise UncontainedStepError(
                    f"two steps in a row failed with no request to end: {error!r}"
                ) from error
            self.last_empty_failure = step
        logger.error(
            "a step failed; ending its %d requests, retracting %d others",
            len(failed),
            len(retracted),
            exc_info=error,
        )
        try:
            self._release(failed, retracted, failure_message(error))
        except Exception as e:
            raise UncontainedStepError(f"recovering from a failed step failed: {e!r}") from e
        self.contained += 1
        return failed

    def _release(self, failed: list[Req], retracted: list[Req], message: str) -> None:
        self.worker.quiesce()
        self.drop_launched()
        ended = {id(r) for r in failed} | {id(r) for r in retracted}
        self.intake.waiting_queue[:] = [r for r in self.intake.waiting_queue if id(r) not in ended]
        for req in failed:
            req.abort(message, 500, "InternalServerError")
            req.time_stats.finish_time = time.perf_counter()
            self.streamer.add(req)
        for req in self.streamer.unanswered.values():
            if req.finished():  # finished before the failure, its final message not sent yet
                self.streamer.add(req)
        self.pools.reset()
        self.pools.check()
        for req in retracted:
            req.reset_for_retract()
        self.intake.requeue(retracted)


class SchedulerParts(Protocol):
    tree_cache: BasePrefixCache
    token_to_kv_pool_allocator: BaseTokenToKVPoolAllocator
    req_to_token_pool: ReqToTokenPool
    drafter: Resettable | None
    model_worker: Quiescable
    intake: RequestIntake
    streamer: OutputStreamer
    result_queue: deque


def make_step_recovery(s: SchedulerParts) -> StepRecovery:
    pools = RecoveryPools(s.tree_cache, s.token_to_kv_pool_allocator, s.req_to_token_pool, s.drafter)
    return StepRecovery(pools, s.model_worker, s.intake, s.streamer, s.result_queue.clear)
