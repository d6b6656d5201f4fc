"""What one step of the event loop does: the batch to run and the running batch after it."""

from __future__ import annotations

from dataclasses import dataclass

from radixengine.managers.schedule_batch import ScheduleBatch


@dataclass(frozen=True)
class StepPlan:
    batch: ScheduleBatch | None  # None: nothing to run this step
    # The decode batch from now on: the last prefill merged in, finished requests filtered out,
    # retracted ones removed, or a new empty batch when its requests joined a mixed prefill.
    running_batch: ScheduleBatch
