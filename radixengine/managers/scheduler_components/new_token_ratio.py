"""SGLang's new-token ratio: the share of a running request's remaining `max_new_tokens` that
admission reserves. It decays toward its minimum with every decode step that fits, jumps to the
estimate a retraction computes, and resets when the scheduler goes idle."""

from __future__ import annotations


class NewTokenRatioTracker:
    def __init__(self, init_ratio: float, min_ratio: float, decay: float) -> None:
        self.init_ratio = init_ratio
        self.min_ratio = min_ratio
        self.decay_step = decay
        self.value = init_ratio

    def decay(self) -> None:
        """A decode step fitted: reserve a little less."""
        self.value = max(self.value - self.decay_step, self.min_ratio)

    def set_after_retract(self, ratio: float) -> None:
        self.value = ratio

    def reset(self) -> None:
        self.value = self.init_ratio
