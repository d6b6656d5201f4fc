"""The adaptive off-switch: a weight-bound small batch speculates, a compute-bound large batch
with poor acceptance does not, shadow drafts switch it back on, probes without shadows."""

from __future__ import annotations

from radixengine.speculative.adaptive import AdaptiveSpecConfig, AdaptiveSpeculation, ShadowDraft


def _cpu_like_seconds(num_tokens: int) -> float:
    """A forward that reads the weights once (10 ms) plus 0.1 ms of compute per token."""
    return 0.010 + 0.0001 * num_tokens


def _warm(ctl: AdaptiveSpeculation, bs: int, n: int, accept: int) -> None:
    for _ in range(3):
        ctl.record_decode(bs, _cpu_like_seconds(bs))
        ctl.record_verify(bs * n, _cpu_like_seconds(bs * n), [accept] * bs)


def test_small_batch_speculates_large_batch_with_poor_acceptance_does_not() -> None:
    small = AdaptiveSpeculation()
    _warm(small, 1, 8, accept=1)  # E = 2 tokens a step for ~8% more time
    assert small.should_speculate(1, 8)
    assert 1.8 < small.speedup(1, 8) < 2.0
    large = AdaptiveSpeculation()
    _warm(large, 32, 8, accept=1)  # 256 tokens: 35.6 ms against 13.2 ms, E = 2 is not enough
    assert not large.should_speculate(32, 256)
    good = AdaptiveSpeculation()
    _warm(good, 32, 8, accept=4)  # E = 5 pays even there
    assert good.should_speculate(32, 256)


def test_unmeasured_buckets_are_explored_and_empty_drafts_never_verified() -> None:
    ctl = AdaptiveSpeculation()
    assert ctl.should_speculate(4, 32)  # no verify timing yet
    ctl.record_verify(32, _cpu_like_seconds(32), [0] * 4)
    ctl.record_verify(32, _cpu_like_seconds(32), [0] * 4)
    assert not ctl.should_speculate(4, 32)  # no decode timing yet: run plain to measure it
    assert not ctl.should_speculate(4, 4)  # nothing drafted


def test_shadow_drafts_switch_it_back_on() -> None:
    ctl = AdaptiveSpeculation(AdaptiveSpecConfig(decay=0.5))
    _warm(ctl, 8, 8, accept=0)
    assert not ctl.should_speculate(8, 64)
    shadow = ShadowDraft([5, 6, 7])
    assert [shadow.feed(t) for t in (5, 6, 7)] == [None, None, 3]
    assert ShadowDraft([5, 6]).feed(9) == 0
    for _ in range(6):
        ctl.record_acceptance([3] * 8)
    assert ctl.should_speculate(8, 64)


def test_probe_without_shadows() -> None:
    ctl = AdaptiveSpeculation(AdaptiveSpecConfig(probe_interval=5), shadow=False)
    _warm(ctl, 32, 8, accept=0)
    decisions = []
    for _ in range(6):
        decisions.append(ctl.should_speculate(32, 256))
        ctl.record_decode(32, _cpu_like_seconds(32))
    assert decisions == [False] * 5 + [True]
