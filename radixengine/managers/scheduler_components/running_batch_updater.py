"""The decode side of a step (SGLang's update_running_batch): the running batch drops its
finished requests, retracts when the next step does not fit, and is prepared for decode (or, with
speculative decoding and drafts that fit, for a verify step)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from radixengine.managers.overlap_utils import StepTimer
from radixengine.managers.schedule_batch import ScheduleBatch
from radixengine.managers.scheduler_components.new_token_ratio import NewTokenRatioTracker
from radixengine.managers.scheduler_components.output_streamer import OutputStreamer
from radixengine.managers.scheduler_components.overlap_spec_step import OverlapSpecStep, refresh_upper_lens
from radixengine.managers.scheduler_components.request_intake import RequestIntake
from radixengine.managers.scheduler_components.scheduler_stats import SchedulerStats
from radixengine.managers.scheduler_components.speculative_drafter import Drafter
from radixengine.utils.fault_injection import fault_point

logger = logging.getLogger("radixengine.managers.scheduler")


@dataclass(frozen=True)
class RetractionConfig:
    retract_decode_steps: int
    retraction_policy: str
    schedule_low_priority_values_first: bool


class RunningBatchUpdater:
    def __init__(
        self,
        config: RetractionConfig,
        ratio: NewTokenRatioTracker,
        stats: SchedulerStats,
        intake: RequestIntake,
        streamer: OutputStreamer,
        note_departures: Callable[[int, ScheduleBatch], None],
        drafter: Drafter | None = None,
        timer: StepTimer | None = None,
        overlap_spec: OverlapSpecStep | None = None,
    ) -> None:
        self.config = config
        self.ratio = ratio
        self.stats = stats
        self.intake = intake
        self.streamer = streamer
        self.note_departures = note_departures  # admission's batch_is_full bookkeeping
        self.drafter = drafter  # speculative decoding: a verify step instead of a decode step
        self.timer = timer or StepTimer()
        self.overlap_spec = overlap_spec  # speculative decoding under the overlap loop

    def update_running_batch(self, batch: ScheduleBatch) -> ScheduleBatch:
        # Measured before the filter: requests that finished last step free their rows and
        # tokens, and the next prefill round must see it (else batching turns static).
        initial_bs = batch.batch_size()
        batch.filter_batch()
        if self.overlap_spec is not None and not batch.is_empty():
            refresh_upper_lens(batch)
        if not batch.is_empty():
            if batch.check_decode_mem():
                self.ratio.decay()
            else:
                self._retract_decode(batch)
        self.note_departures(initial_bs, batch)
        if not batch.is_empty():
            self._prepare_next_step(batch)
        return batch

    def _prepare_next_step(self, batch: ScheduleBatch) -> None:
        """A verify step when the drafter has drafts and they fit; else a decode step."""
        if self.overlap_spec is not None:
            self.overlap_spec.prepare(batch)
            return
        trees = None
        if self.drafter is not None:
            with self.timer.phase("draft"):
                fault_point("drafter")
                trees = self.drafter.draft(batch)
        if trees is not None and batch.check_verify_mem(trees):
            batch.prepare_for_verify(trees)
        else:
            batch.prepare_for_decode()

    def _retract_decode(self, batch: ScheduleBatch) -> None:
        old_ratio = self.ratio.value
        c = self.config
        result = batch.retract_decode(
            c.retract_decode_steps, c.retraction_policy, c.schedule_low_priority_values_first
        )
        # An empty batch (its last request aborted) keeps the ratio: nothing to estimate from.
        if not batch.is_empty():
            self.ratio.set_after_retract(result.new_token_ratio)
        for req in result.aborted:
            req.time_stats.finish_time = time.perf_counter()
            self.streamer.add(req)
            logger.warning("retract_decode: aborted the last request %s: out of KV memory", req.rid)
        self.stats.add_retracted(len(result.retracted))
        logger.info(
            "KV cache pool is full. Retract requests. #retracted_reqs: %d, #new_token_ratio: %.4f -> %.4f",
            len(result.retracted),
            old_ratio,
            self.ratio.value,
        )
        self.intake.requeue(result.retracted)
