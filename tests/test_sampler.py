"""Sampler and SamplingBatchInfo: greedy, truncation sets, distributions, seeds, logprobs, NaN."""

from __future__ import annotations

import pytest
import torch

from radixengine.layers.sampler import Sampler, argmax_rows
from radixengine.sampling.sampling_batch_info import SamplingBatchInfo
from radixengine.sampling.sampling_params import SamplingParams


def _chi2_crit(dof: int, z: float = 3.719) -> float:
    """Chi-square critical value at p = 1e-4 (Wilson-Hilferty); 7 dof gives 29.9 (table: 29.88)."""
    a = 2.0 / (9 * dof)
    return dof * (1 - a + z * a**0.5) ** 3


def _info(
    params: list[SamplingParams], vocab: int | None, steps: list[int] | None = None, device: str = "cpu"
) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_sampling_params(params, steps or [0] * len(params), device, vocab)


def _sample(
    logits: torch.Tensor, params: list[SamplingParams], steps: list[int] | None = None, logprob=False
):
    info = _info(params, logits.shape[-1], steps, str(logits.device))
    ids, logprobs, invalid_rows, _ = Sampler()(logits, info, logprob)
    assert invalid_rows is None, "use Sampler() directly for rows with nothing to sample"
    return ids, logprobs


def _repeat(row: torch.Tensor, n: int, **kw) -> tuple[torch.Tensor, list[SamplingParams]]:
    return row.view(1, -1).expand(n, -1).contiguous(), [SamplingParams(**kw) for _ in range(n)]


def _chi2(ids: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Chi-square statistic of the draws against probs (cells with p > 0), and its dof."""
    support = probs > 0
    counts = torch.bincount(ids, minlength=probs.numel()).double()
    assert counts[~support].sum() == 0, "drew a token outside the support"
    expected = probs.double()[support] * ids.numel()
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    return stat, int(support.sum()) - 1


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)


def test_batch_info_fields_and_flags() -> None:
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=-1, top_p=0.9, sampling_seed=5),
        SamplingParams(top_k=20, min_p=0.1),
    ]
    info = _info(params, 100, [0, 3, 7])
    assert info.temperatures.dtype == torch.float32 and info.temperatures.shape == (3, 1)
    assert info.temperatures.view(-1).tolist() == pytest.approx([1.0, 0.7, 1.0])
    assert info.top_ks.dtype == torch.int64 and info.top_ks.tolist() == [1, 100, 20]
    assert info.top_ps.tolist() == pytest.approx([1.0, 0.9, 1.0])
    assert info.min_ps.tolist() == pytest.approx([0.0, 0.0, 0.1])
    assert info.seeds.dtype == torch.int64 and info.seeds.tolist() == [0, 5, 0]
    assert info.seeded_rows.tolist() == [1]
    assert info.steps.tolist() == [0, 3, 7]
    assert not info.is_all_greedy and info.has_greedy and info.has_seed and not info.all_seeded
    assert info.need_top_p_sampling and info.need_top_k_sampling and info.need_min_p_sampling
    assert info.max_top_k is None  # row 1 keeps the whole vocabulary

    plain = _info([SamplingParams(), SamplingParams(temperature=0)], 100)
    assert plain.seeds is None and plain.seeded_rows is None and not plain.has_seed
    assert not (plain.need_top_k_sampling or plain.need_top_p_sampling or plain.need_min_p_sampling)
    greedy = _info([SamplingParams(temperature=0, top_p=0.5)] * 2, 100)
    assert greedy.is_all_greedy and not greedy.need_top_p_sampling
    with pytest.raises(ValueError):
        SamplingBatchInfo.from_sampling_params([SamplingParams()], [0, 1], "cpu", 10)


def test_temperature_zero_is_argmax() -> None:
    logits = torch.randn(64, 1000)
    ids, logprobs = _sample(logits, [SamplingParams(temperature=0)] * 64, logprob=True)
    assert ids.dtype == torch.int64 and torch.equal(ids, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(1, ids.view(-1, 1)).view(-1)
    assert logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, expected)


def test_mixed_batch_greedy_rows_equal_argmax() -> None:
    kinds = [
        dict(temperature=0),
        dict(temperature=1.5),
        dict(top_k=3),
        dict(top_p=0.5, sampling_seed=1),
        dict(min_p=0.3),
    ]
    params = [SamplingParams(**kinds[i % len(kinds)]) for i in range(200)]
    logits = torch.randn(200, 300) * 2
    ids, logprobs = _sample(logits, params, logprob=True)
    greedy = torch.tensor([p.is_greedy for p in params])
    assert torch.equal(ids[greedy], logits.argmax(-1)[greedy])
    assert not torch.equal(ids[~greedy], logits.argmax(-1)[~greedy])
    scaled = logits / torch.tensor([p.temperature for p in params]).view(-1, 1)
    expected = torch.log_softmax(scaled, -1).gather(1, ids.view(-1, 1)).view(-1)
    torch.testing.assert_close(logprobs, expected)


def test_top_k_stays_in_the_k_largest_and_covers_them() -> None:
    row = torch.randn(50)
    logits, params = _repeat(row, 4000, top_k=5)
    ids, _ = _sample(logits, params)
    top5 = set(row.topk(5).indices.tolist())
    assert set(ids.tolist()) == top5
    probs = torch.zeros(50)
    probs[list(top5)] = torch.softmax(row, -1)[list(top5)]
    stat, dof = _chi2(ids, probs / probs.sum())
    assert stat < _chi2_crit(dof)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """SGLang's top-p set: sorted descending, keep while the mass before a token is <= top_p."""
    values, order = probs.sort(descending=True)
    kept = order[(values.cumsum(0) - values) <= top_p]
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


@pytest.mark.parametrize("vocab, scale", [(40, 1.0), (2000, 3.0)])  # full sort, and top-k pre-select
def test_top_p_stays_in_the_nucleus(vocab: int, scale: float) -> None:
    row = torch.randn(vocab) * scale
    target = _nucleus(torch.softmax(row, -1), 0.6)
    logits, params = _repeat(row, 4000, top_p=0.6)
    ids, _ = _sample(logits, params)
    assert target[ids].gt(0).all()
    stat, dof = _chi2(ids, target)
    assert dof >= 2 and stat < _chi2_crit(dof)


def test_top_p_nucleus_edges() -> None:
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    for top_p, allowed in [(0.51, {0, 1}), (0.49, {0}), (0.81, {0, 1, 2}), (1.0, {0, 1, 2, 3})]:
        logits, params = _repeat(row, 2000, top_p=top_p)
        assert set(_sample(logits, params)[0].tolist()) == allowed, top_p


def test_top_k_then_top_p() -> None:
    row = torch.log(torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1]))
    logits, params = _repeat(row, 3000, top_k=2, top_p=0.9)
    assert set(_sample(logits, params)[0].tolist()) == {0, 1}
    logits, params = _repeat(row, 3000, top_k=4, top_p=0.6)
    assert set(_sample(logits, params)[0].tolist()) == {0, 1, 2}


def test_min_p_keeps_tokens_above_fraction_of_max() -> None:
    row = torch.randn(60) * 2
    probs = torch.softmax(row, -1)
    logits, params = _repeat(row, 4000, min_p=0.2)
    ids, _ = _sample(logits, params)
    allowed = probs >= 0.2 * probs.max()
    assert allowed[ids].all()
    target = torch.where(allowed, probs, 0.0)
    stat, dof = _chi2(ids, target / target.sum())
    assert dof >= 2 and stat < _chi2_crit(dof)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_distribution_matches_softmax(temperature: float) -> None:
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3, 1.5])
    logits, params = _repeat(row, 20000, temperature=temperature)
    ids, _ = _sample(logits, params)
    stat, dof = _chi2(ids, torch.softmax(row / temperature, -1))
    assert stat < _chi2_crit(dof)


def test_seeded_draws_follow_softmax_across_seeds() -> None:
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3, 1.5])
    n = 20000
    logits = row.view(1, -1).expand(n, -1).contiguous()
    params = [SamplingParams(sampling_seed=s) for s in range(n)]
    ids, _ = _sample(logits, params, steps=[7] * n)
    stat, dof = _chi2(ids, torch.softmax(row, -1))
    assert stat < _chi2_crit(dof)
    # And along the steps of one seed.
    ids, _ = _sample(logits, [SamplingParams(sampling_seed=99)] * n, steps=list(range(n)))
    stat, dof = _chi2(ids, torch.softmax(row, -1))
    assert stat < _chi2_crit(dof)


def _seeded_run(position: int, others: list[SamplingParams], target: SamplingParams, logits_row, steps):
    """Tokens of `target` over `steps`, placed at `position` among `others` (random logits)."""
    out = []
    for step in steps:
        params = others[:position] + [target] + others[position:]
        logits = torch.randn(len(params), logits_row.numel(), device=logits_row.device) * 3
        logits[position] = logits_row
        step_list = [int(torch.randint(0, 100, ()).item()) for _ in params]
        step_list[position] = step
        out.append(int(_sample(logits, params, steps=step_list)[0][position]))
    return out


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.8, top_p=0.9), dict(top_k=10), dict(min_p=0.05)])
def test_same_seed_same_tokens_in_any_batch(kw: dict) -> None:
    row = torch.randn(500) * 2
    target = SamplingParams(sampling_seed=42, **kw)
    steps = list(range(20))
    alone = _seeded_run(0, [], target, row, steps)
    others_a = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_k=3, sampling_seed=1)]
    others_b = [SamplingParams(top_p=0.3), SamplingParams(min_p=0.5)] * 3 + [SamplingParams(top_k=200)]
    assert _seeded_run(2, others_a, target, row, steps) == alone
    assert _seeded_run(5, others_b, target, row, steps) == alone
    assert _seeded_run(0, [SamplingParams(sampling_seed=s) for s in range(4)], target, row, steps) == alone
    with_logprob = [int(Sampler()(row.view(1, -1), _info([target], 500, [s]), True)[0][0]) for s in steps]
    assert with_logprob == alone
    assert len(set(alone)) > 1  # steps differ


def test_different_seeds_differ() -> None:
    row = torch.zeros(1000)
    steps = list(range(16))
    runs = {
        seed: tuple(
            _sample(row.view(1, -1), [SamplingParams(sampling_seed=seed)], [s])[0].item() for s in steps
        )
        for seed in (0, 1, 2, 2**40, 2**63 + 5)
    }
    assert len(set(runs.values())) == len(runs)


def test_unseeded_rows_use_torch_rng() -> None:
    logits, params = _repeat(torch.zeros(1000), 8)
    torch.manual_seed(7)
    first = _sample(logits, params)[0]
    torch.manual_seed(7)
    assert torch.equal(_sample(logits, params)[0], first)
    assert not torch.equal(_sample(logits, params)[0], first)


@pytest.mark.parametrize("sync_free", [False, True], ids=["host_check", "device_flag"])
def test_nan_and_inf_logits(sync_free: bool) -> None:
    """The same tokens and flags whether the check reads the device (CPU) or keeps its flag on
    the device (GPU: read with the tokens when the result is processed)."""
    sampler = Sampler(sync_free=sync_free)
    logits = torch.randn(4, 20)
    logits[0, :10] = float("nan")
    logits[1, 3] = float("inf")
    logits[1, 7] = float("inf")
    logits[2, 5] = float("-inf")
    logits[3, :] = float("-inf")
    logits[3, 9] = 0.0
    params = [SamplingParams()] * 4
    for _ in range(20):
        ids, logprobs, invalid_rows, _ = sampler(logits, _info(params, 20), True)
        assert invalid_rows is None or not invalid_rows.any()
        assert ids[0] >= 10 and ids[1] in (3, 7) and ids[2] != 5 and ids[3] == 9
        assert torch.isfinite(logprobs).all()
    greedy_ids = sampler(logits, _info([SamplingParams(temperature=0)] * 4, 20))[0]
    assert greedy_ids[0] >= 10 and greedy_ids[1] == 3 and greedy_ids[3] == 9

    bad = torch.randn(3, 20)
    bad[1] = float("nan")
    bad[2, :] = float("-inf")
    for params in ([SamplingParams()] * 3, [SamplingParams(temperature=0)] * 3):
        ids, _, invalid_rows, _ = sampler(bad, _info(params, 20), True)
        assert invalid_rows.tolist() == [False, True, True]  # flagged, not raised
        assert ((ids >= 0) & (ids < 20)).all()  # still valid ids (their results are void)


def test_sync_free_sampling_draws_what_the_host_path_draws() -> None:
    """Top-p without reading the device sorts the whole vocabulary; the kept set, and so every
    seeded draw, is the host path's."""
    logits = torch.randn(6, 300) * 3
    params = [
        SamplingParams(top_p=p, top_k=k, sampling_seed=s)
        for p, k, s in [(0.5, -1, 1), (0.9, 40, 2), (1.0, 5, 3), (0.3, -1, 4), (0.95, 200, 5), (0.7, 3, 6)]
    ]
    for step in range(10):
        info = _info(params, 300, [step] * 6)
        host = Sampler()(logits, info, True)
        device = Sampler(sync_free=True)(logits, info, True)
        assert torch.equal(host[0], device[0]) and torch.allclose(host[1], device[1])


def test_without_vocab_size_and_low_precision_logits() -> None:
    row = torch.randn(100)
    logits, params = _repeat(row, 500, top_k=4)
    info = SamplingBatchInfo.from_sampling_params(params, [0] * 500, "cpu")
    ids, _, _, _ = Sampler()(logits.bfloat16(), info, False)
    assert set(ids.tolist()) <= set(row.bfloat16().float().topk(6).indices.tolist())
    info = SamplingBatchInfo.from_sampling_params([SamplingParams(top_p=0.5)] * 2, [0, 0], "cpu")
    assert Sampler()(logits[:2], info, True)[0].shape == (2,)


def test_empty_batch() -> None:
    info = _info([], 10)
    ids, logprobs, _, _ = Sampler()(torch.empty(0, 10), info, True)
    assert ids.shape == (0,) and logprobs.shape == (0,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda() -> None:
    row = torch.randn(32000, device="cuda") * 3
    logits = torch.randn(64, 32000, device="cuda") * 3
    ids, _ = _sample(logits, [SamplingParams(temperature=0)] * 64)
    assert torch.equal(ids, logits.argmax(-1))
    mixed = [SamplingParams(temperature=0), SamplingParams(top_k=20), SamplingParams(top_p=0.8)] * 20
    ids, logprobs = _sample(logits[:60], mixed, logprob=True)
    assert torch.equal(ids[::3], logits[:60:3].argmax(-1)) and torch.isfinite(logprobs).all()
    batch, params = _repeat(row, 2000, top_k=7)
    assert set(_sample(batch, params)[0].tolist()) <= set(row.topk(7).indices.tolist())
    target = _nucleus(torch.softmax(row, -1), 0.5)
    batch, params = _repeat(row, 2000, top_p=0.5)
    assert target[_sample(batch, params)[0]].gt(0).all()
    seeded = SamplingParams(sampling_seed=3, top_p=0.95)
    alone = _seeded_run(0, [], seeded, row, range(8))
    assert _seeded_run(3, [SamplingParams(top_k=5), SamplingParams()] * 3, seeded, row, range(8)) == alone


@pytest.mark.parametrize("seed", range(6))
def test_argmax_rows_equals_torch_argmax(seed: int) -> None:
    """Ties (the first), NaN (the largest), +-inf, rows of one value; float32 (numpy's reduction)
    and the other cases (torch's)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (40, 300), generator=gen).float()  # many ties
    special = torch.rand(40, 300, generator=gen)
    x[special < 0.01] = float("nan")
    x[(special > 0.5) & (special < 0.51)] = float("inf")
    x[special > 0.98] = float("-inf")
    x[0] = float("-inf")
    x[1] = 2.0
    for t in (x, x[:, ::2], x.to(torch.bfloat16), x[:7]):
        assert argmax_rows(t).tolist() == torch.argmax(t, dim=-1).tolist()
