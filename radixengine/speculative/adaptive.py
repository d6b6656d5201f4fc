"""When speculation pays: an online cost model of the forward and an estimate of the tokens a
verify step emits per request, deciding per step between a verify step and a plain decode step.

Rule: speculate when E * t_decode(bs) / t_verify(T) > margin, where E is the mean number of tokens
a request gets from a verify step (accept length + 1, an EMA), t_decode(bs) the measured time of a
plain decode step of the batch, and t_verify(T) that of a verify extend of T = sum(num_nodes)
tokens (EMAs per power-of-two bucket of tokens). That is: speculation's output tok/s over plain
decoding's. On a CPU a small batch is bound by reading the weights, so t_verify(bs * n) is close
to t_decode(bs) and any E > 1 wins; a large batch is compute bound, t_verify grows with T, and
speculation stops unless acceptance is high.

A bucket without timings is explored first (one step of that kind measures it). While off, E is
kept fresh without device cost for NGRAM by shadow drafts (`ShadowDraft`: draft as if on, compare
with the tokens plain decoding then emits); a drafter without shadows (a draft model) gets one
probing verify step every `probe_interval` plain steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class AdaptiveSpecConfig:
    margin: float = 1.05  # speculation must beat plain decoding by this factor
    decay: float = 0.8  # EMA weight of the past
    min_samples: int = 2  # timings a bucket needs before it is used
    probe_interval: int = 64  # plain steps between probes when no shadow estimates come


@dataclass
class _Ema:
    value: float = 0.0
    samples: int = 0

    def add(self, x: float, decay: float) -> None:
        self.value = x if self.samples == 0 else decay * self.value + (1 - decay) * x
        self.samples += 1


def _bucket(num_tokens: int) -> int:
    return max(num_tokens - 1, 0).bit_length()


@dataclass
class StepCostModel:
    """Seconds per forward, by kind ("decode", "verify") and power-of-two bucket of tokens."""

    config: AdaptiveSpecConfig = field(default_factory=AdaptiveSpecConfig)
    _times: dict[tuple[str, int], _Ema] = field(default_factory=dict)

    def record(self, kind: str, num_tokens: int, seconds: float) -> None:
        self._times.setdefault((kind, _bucket(num_tokens)), _Ema()).add(seconds, self.config.decay)

    def estimate(self, kind: str, num_tokens: int) -> float | None:
        ema = self._times.get((kind, _bucket(num_tokens)))
        return ema.value if ema is not None and ema.samples >= self.config.min_samples else None


class AdaptiveSpeculation:
    def __init__(self, config: AdaptiveSpecConfig | None = None, shadow: bool = True) -> None:
        self.config = config or AdaptiveSpecConfig()
        self.shadow = shadow  # the drafter reports shadow acceptance while off (NGRAM)
        self.cost = StepCostModel(self.config)
        self._tokens_per_step = _Ema()
        self._plain_steps_since_verify = 0

    @property
    def expected_tokens(self) -> float | None:
        """E: tokens per request per verify step (None before any estimate)."""
        return self._tokens_per_step.value if self._tokens_per_step.samples else None

    def record_decode(self, batch_size: int, seconds: float) -> None:
        self.cost.record("decode", batch_size, seconds)
        self._plain_steps_since_verify += 1

    def record_verify(self, num_tokens: int, seconds: float, accept_lens: list[int]) -> None:
        self.cost.record("verify", num_tokens, seconds)
        self.record_acceptance(accept_lens)
        self._plain_steps_since_verify = 0

    def record_acceptance(self, accept_lens: list[int]) -> None:
        """Accept lengths from a verify step, or from shadow drafts while off."""
        if accept_lens:
            mean = sum(accept_lens) / len(accept_lens) + 1
            self._tokens_per_step.add(mean, self.config.decay)

    def speedup(self, batch_size: int, num_verify_tokens: int) -> float | None:
        """Estimated output tok/s of a verify step over a plain step (None: not yet measured)."""
        t_plain = self.cost.estimate("decode", batch_size)
        t_verify = self.cost.estimate("verify", num_verify_tokens)
        e = self.expected_tokens
        if t_plain is None or t_verify is None or e is None:
            return None
        return e * t_plain / t_verify

    def should_speculate(self, batch_size: int, num_verify_tokens: int) -> bool:
        if num_verify_tokens <= batch_size:
            return False  # nothing drafted: a verify step is a decode step
        if self.cost.estimate("verify", num_verify_tokens) is None or self.expected_tokens is None:
            return True  # measure it
        if self.cost.estimate("decode", batch_size) is None:
            return False
        gain = self.speedup(batch_size, num_verify_tokens)
        if gain > self.config.margin:
            return True
        return not self.shadow and self._plain_steps_since_verify >= self.config.probe_interval


class ShadowDraft:
    """A draft made while speculation is off (its main branch), settled against the tokens that
    plain decoding then emits: its accept length, as a verify step would have had it."""

    def __init__(self, draft_tokens: list[int]) -> None:
        self.draft_tokens = list(draft_tokens)
        self.matched = 0

    def feed(self, token: int) -> int | None:
        """The next emitted token; the accept length once settled (a mismatch, or all matched)."""
        if self.matched < len(self.draft_tokens) and token == self.draft_tokens[self.matched]:
            self.matched += 1
            return self.matched if self.matched == len(self.draft_tokens) else None
        return self.matched
