"""Draft verification: greedy and seeded outputs equal plain decoding token for token (chains and
trees, with penalties, logit_bias, min_new_tokens, top-k/top-p/min-p); rejection sampling keeps
the target distribution (and a wrong rule fails the same check); the draft-model rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixengine.layers.sampler import Sampler
from radixengine.sampling.output_token_counts import OutputTokenCounts
from radixengine.sampling.sampling_batch_info import SamplingBatchInfo
from radixengine.sampling.sampling_params import SamplingParams
from radixengine.speculative.spec_tree import DraftTrees
from radixengine.speculative.spec_verify import (
    _target_probs,
    cumulate_accepted,
    process_target_logits,
    takes_argmax_only,
    verify_draft_model,
    verify_tree,
    verify_tree_argmax,
)

VOCAB = 12
EOS = 11


def _chi2_crit(dof: int, z: float = 3.719) -> float:
    """Chi-square critical value at p = 1e-4 (Wilson-Hilferty)."""
    a = 2.0 / (9 * dof)
    return dof * (1 - a + z * a**0.5) ** 3


def _batch_info(
    params: list[SamplingParams], steps: list[int], outputs: list[list[int]]
) -> SamplingBatchInfo:
    info = SamplingBatchInfo.from_sampling_params(params, steps, "cpu", VOCAB, frozenset({EOS}))
    if info.need_penalties:
        info.output_token_counts = OutputTokenCounts.from_output_ids(outputs, VOCAB, "cpu")
        info.output_token_counts_out = torch.empty(len(params), VOCAB)
    return info


def _plain_decode(logits: torch.Tensor, tokens, parents, params, step, outputs) -> list[int]:
    """What plain decoding emits along the tree: sample at a node with the real Sampler, move to
    the child with that token, stop where there is none (the emitted token is the bonus)."""
    node, emitted = 0, []
    while True:
        info = _batch_info([params], [step + len(emitted)], [outputs + emitted])
        token = int(Sampler()(logits[node].clone().view(1, -1), info)[0][0])
        emitted.append(token)
        child = next((j for j in range(1, len(tokens)) if parents[j] == node and tokens[j] == token), None)
        if child is None:
            return emitted
        node = child


def _draft_like(logits: torch.Tensor, tokens: list[int], parents: list[int], hit: float, gen) -> list[int]:
    """Drafted tokens that often equal the greedy choice at their parent (so runs get accepted)."""
    out = list(tokens)
    for j in range(1, len(out)):
        if torch.rand(1, generator=gen).item() < hit:
            out[j] = int(torch.argmax(logits[parents[j]]))
    return out


def _random_tree(n: int, gen) -> list[int]:
    return [-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, n)]


PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.3),
    SamplingParams(temperature=0, logit_bias={"3": 4.0}, min_new_tokens=3),
    SamplingParams(temperature=0.8, top_p=0.9, sampling_seed=7),
    SamplingParams(temperature=1.2, top_k=5, min_p=0.05, sampling_seed=11, frequency_penalty=0.5),
    SamplingParams(temperature=0.6, sampling_seed=3, min_new_tokens=2, repetition_penalty=1.2),
]


def _check_against_plain(tree: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    n, bs = 6, len(PARAMS)
    logits = torch.randn(bs, n, VOCAB, generator=gen) * 3
    drafts, outputs, steps = [], [], []
    for b in range(bs):
        parents = _random_tree(n, gen) if tree else list(range(-1, n - 1))
        tokens = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        if tree:  # distinct siblings, as a drafter builds them
            tokens = [(t + j) % VOCAB for j, t in enumerate(tokens)]
        drafts.append((np.array(_draft_like(logits[b], tokens, parents, 0.8, gen)), np.array(parents)))
        outputs.append(torch.randint(0, VOCAB, (b,), generator=gen).tolist())
        steps.append(len(outputs[-1]))
    trees = DraftTrees.from_drafts(drafts, n)
    info = _batch_info(PARAMS, steps, outputs)
    result = verify_tree(logits.clone(), trees, info)
    for b in range(bs):
        want = _plain_decode(logits[b], drafts[b][0], drafts[b][1], PARAMS[b], steps[b], outputs[b])
        got = result.output_ids[b, : int(result.accept_lens[b]) + 1].tolist()
        assert got == want, f"row {b}: {got} != plain decoding {want}"
        assert (result.output_ids[b, len(want) :] == -1).all()


@pytest.mark.parametrize("seed", range(8))
def test_chain_equals_plain_decoding(seed: int) -> None:
    _check_against_plain(tree=False, seed=seed)


@pytest.mark.parametrize("seed", range(8))
def test_tree_equals_plain_decoding(seed: int) -> None:
    _check_against_plain(tree=True, seed=seed)


def test_greedy_accepts_matching_prefix_only() -> None:
    logits = torch.full((2, 4, VOCAB), -5.0)
    for j, t in enumerate([4, 5, 6, 7]):
        logits[:, j, t] = 5.0
    trees = DraftTrees.chains(torch.tensor([[1, 4, 5, 9], [1, 4, 5, 6]]), [4, 3])
    info = _batch_info([SamplingParams(temperature=0)] * 2, [0, 0], [[], []])
    result = verify_tree(logits, trees, info, return_logprob=True)
    assert result.accept_lens.tolist() == [2, 2]
    assert result.output_ids.tolist() == [[4, 5, 6, -1], [4, 5, 6, -1]]  # row 1 has 3 nodes: bonus 6
    assert result.path_nodes.tolist() == [[0, 1, 2, -1], [0, 1, 2, -1]]
    want = torch.log_softmax(logits[0, :3], dim=-1)[torch.arange(3), torch.tensor([4, 5, 6])]
    assert torch.allclose(result.logprobs[0, :3], want, atol=1e-6) and result.logprobs[0, 3] == 0


def test_tree_picks_the_matching_branch_and_kv_path() -> None:
    # root -> {a=2 (node 1), b=3 (node 2)}; node 2 -> c=4 (node 3); the target says 3 then 4 then 9.
    logits = torch.full((1, 4, VOCAB), -5.0)
    logits[0, 0, 3] = logits[0, 2, 4] = logits[0, 3, 9] = 5.0
    logits[0, 1, 0] = 5.0
    trees = DraftTrees.from_drafts([(np.array([1, 2, 3, 4]), np.array([-1, 0, 0, 2]))], 4)
    info = _batch_info([SamplingParams(temperature=0)], [0], [[]])
    result = verify_tree(logits.clone(), trees, info, return_logprob=True, top_logprobs_num=2)
    assert result.accept_lens.tolist() == [2]
    assert result.output_ids.tolist() == [[3, 4, 9, -1]]
    assert result.path_nodes.tolist() == [[0, 2, 3, -1]]
    # each output token's logprob comes from its node on the path: nodes 0, 2, 3
    want = torch.log_softmax(logits[0, [0, 2, 3]], dim=-1)[torch.arange(3), torch.tensor([3, 4, 9])]
    assert torch.allclose(result.logprobs[0, :3], want, atol=1e-6)
    assert result.top_logprobs.idx.view(1, 4, 2)[0, :3, 0].tolist() == [3, 4, 9]


def test_repeated_sibling_counts_once() -> None:
    logits = torch.full((1, 3, VOCAB), -5.0)
    logits[0, 0, 2] = logits[0, 1, 5] = logits[0, 2, 6] = 5.0
    trees = DraftTrees.from_drafts([(np.array([1, 2, 2]), np.array([-1, 0, 0]))], 3)
    result = verify_tree(logits, trees, _batch_info([SamplingParams(temperature=0)], [0], [[]]))
    assert result.path_nodes[0, :2].tolist() == [0, 1] and result.output_ids[0, 1] == 5


def test_grammar_rows_need_per_node_masks() -> None:
    info = _batch_info([SamplingParams(temperature=0)] * 2, [0, 0], [[], []])
    mask = torch.zeros(2, 1, dtype=torch.int32)
    mask[:, 0] = 1 << 7  # only token 7
    info.vocab_mask, info.vocab_mask_rows = mask, [1]  # a mask row per batch row
    logits = torch.randn(2, 3, VOCAB)
    with pytest.raises(ValueError, match="grammar"):
        verify_tree(logits.clone(), DraftTrees.chains(torch.tensor([[1, 2, 3]] * 2), [3, 3]), info)
    result = verify_tree(logits.clone(), DraftTrees.chains(torch.tensor([[1, 2, 3]] * 2), [3, 1]), info)
    assert result.output_ids[1].tolist() == [7, -1, -1]


def test_nan_node_is_never_accepted() -> None:
    logits = torch.randn(1, 3, VOCAB)
    logits[0, 1] = float("nan")
    drafts = torch.tensor([[1, int(torch.argmax(logits[0, 0])), 0]])
    result = verify_tree(
        logits, DraftTrees.chains(drafts, [3]), _batch_info([SamplingParams(temperature=0)], [0], [[]])
    )
    assert result.accept_lens.tolist() == [1] and result.invalid_rows.tolist() == [True]


@pytest.mark.parametrize("seed", range(6))
def test_argmax_path_equals_verify_tree_without_padding(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    bs, n = 5, 7
    logits = torch.randint(-3, 3, (bs, n, VOCAB), generator=gen).float()  # ties on purpose
    drafts = []
    for b in range(bs):
        count = int(torch.randint(1, n + 1, (1,), generator=gen))
        parents = _random_tree(count, gen) if seed % 2 else list(range(-1, count - 1))
        tokens = torch.randint(0, VOCAB, (count,), generator=gen).tolist()
        drafts.append((np.array(_draft_like(logits[b], tokens, parents, 0.8, gen)), np.array(parents)))
    trees = DraftTrees.from_drafts(drafts, n)
    info = _batch_info([SamplingParams(temperature=0)] * bs, [0] * bs, [[]] * bs)
    assert takes_argmax_only(info, return_logprob=False)
    want = verify_tree(logits.clone(), trees, info)
    got = verify_tree_argmax(logits[trees.valid()], trees)
    assert torch.equal(got.output_ids, want.output_ids) and torch.equal(got.path_nodes, want.path_nodes)
    assert int(want.accept_lens.sum()) > 0


def test_argmax_path_leaves_what_it_cannot_do_to_verify_tree() -> None:
    greedy = _batch_info([SamplingParams(temperature=0)], [0], [[]])
    assert not takes_argmax_only(greedy, return_logprob=True)
    for params in PARAMS[1:]:
        assert not takes_argmax_only(_batch_info([params], [3], [[1, 2]]), return_logprob=False)
    logits = torch.randn(3, VOCAB)
    logits[1, 4] = float("nan")
    assert verify_tree_argmax(logits, DraftTrees.chains(torch.tensor([[1, 2, 3]]), [3])) is None


def test_cumulate_accepted_counts_every_output_token() -> None:
    counts = torch.zeros(2, VOCAB)
    logits = torch.full((2, 3, VOCAB), -5.0)
    logits[:, :, 4] = 5.0
    trees = DraftTrees.chains(torch.tensor([[0, 4, 4], [0, 1, 4]]), [3, 3])
    result = verify_tree(logits, trees, _batch_info([SamplingParams(temperature=0)] * 2, [0, 0], [[], []]))
    cumulate_accepted(counts, result)
    assert counts[0, 4] == 3 and counts[1, 4] == 1 and counts.sum() == 4


# Distribution ------------------------------------------------------------------------------------

SMALL_VOCAB, SAMPLES = 6, 20000
TEMPERATURE, TOP_K = 0.8, 4


def _model_logits(context: tuple[int, ...]) -> torch.Tensor:
    """A fixed toy target: logits that depend on the whole context."""
    seed = 0
    for t in context:
        seed = (seed * 1000003 + t + 1) % (1 << 31)
    return torch.randn(SMALL_VOCAB, generator=torch.Generator().manual_seed(seed)) * 1.5


def _exact_probs(context: tuple[int, ...]) -> torch.Tensor:
    """softmax(logits / T) over the top-k tokens, renormalised (computed here independently)."""
    probs = torch.softmax(_model_logits(context).double() / TEMPERATURE, dim=0)
    probs[torch.argsort(probs, descending=True)[TOP_K:]] = 0
    return probs / probs.sum()


def _chain_logits(context: tuple[int, ...], drafts: list[int]) -> torch.Tensor:
    return torch.stack([_model_logits(context + tuple(drafts[:j])) for j in range(len(drafts) + 1)])


def _pair_stat(first: torch.Tensor, second: torch.Tensor, context: tuple[int, ...]) -> tuple[float, int]:
    """Chi-square of the drawn (first, second) pairs against the target's joint law."""
    p0 = _exact_probs(context)
    joint = torch.stack([p0[a] * _exact_probs(context + (a,)) for a in range(SMALL_VOCAB)]).view(-1)
    counts = torch.bincount(first * SMALL_VOCAB + second, minlength=joint.numel()).double()
    support = joint > 0
    assert counts[~support].sum() == 0, "drew a pair outside the support"
    expected = joint[support] * first.numel()
    return ((counts[support] - expected) ** 2 / expected).sum().item(), int(support.sum()) - 1


def _sample_params(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=TEMPERATURE, top_k=TOP_K) for _ in range(n)]


def _two_tokens(step, context: tuple[int, ...], drafts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The first two emitted tokens of SAMPLES runs: one verify step, and a second (a plain
    decode step, one node) for the rows that emitted one token."""
    n = len(drafts) + 1
    logits = _chain_logits(context, drafts).expand(SAMPLES, n, SMALL_VOCAB).contiguous()
    chains = DraftTrees.chains(torch.tensor([[0, *drafts]]).expand(SAMPLES, n).contiguous(), [n] * SAMPLES)
    first = step(logits, chains)
    tokens = first.output_ids
    one = first.accept_lens == 0
    second = tokens[:, 1].clone()
    rows = torch.nonzero(one).view(-1)
    follow = torch.stack([_model_logits(context + (int(t),)) for t in range(SMALL_VOCAB)])
    logits2 = follow[tokens[rows, 0]].view(-1, 1, SMALL_VOCAB)
    root = DraftTrees.chains(tokens[rows, :1], [1] * len(rows))
    second[rows] = verify_tree(
        logits2, root, _batch_info(_sample_params(len(rows)), [1] * len(rows), [])
    ).output_ids[:, 0]
    return tokens[:, 0], second


def _ngram_step(logits, chains):
    return verify_tree(logits, chains, _batch_info(_sample_params(SAMPLES), [0] * SAMPLES, []))


def _accept_then_resample_from_p(logits, chains):
    """A wrong rule: accept d with probability p(d), but on rejection draw from p (d included)."""
    info = _batch_info(_sample_params(SAMPLES), [0] * SAMPLES, [])
    flat, expanded, _ = process_target_logits(logits, chains, info)
    p = _target_probs(flat, expanded)[0].view(SAMPLES, chains.width, -1)
    drafts = chains.tokens[:, 1:]
    ok = torch.rand(drafts.shape) < p[:, :-1].gather(2, drafts[..., None]).squeeze(2)
    accept = torch.cumprod(ok.long(), dim=1).sum(dim=1)
    bonus = torch.multinomial(p[torch.arange(SAMPLES), accept], 1).view(-1)
    out = torch.cat([drafts, bonus.view(-1, 1)], dim=1)
    col = torch.arange(chains.width)
    out = torch.where(col == accept.view(-1, 1), bonus.view(-1, 1), out)
    return _Fake(accept, out)


class _Fake:
    def __init__(self, accept_lens, output_ids):
        self.accept_lens, self.output_ids = accept_lens, output_ids


CONTEXT = (1, 4, 2)


def _likely_drafts() -> list[int]:
    first = int(torch.argmax(_exact_probs(CONTEXT)))
    return [first, int(torch.argmax(_exact_probs(CONTEXT + (first,))))]


def test_ngram_rejection_sampling_keeps_the_target_distribution() -> None:
    torch.manual_seed(0)
    stat, dof = _pair_stat(*_two_tokens(_ngram_step, CONTEXT, _likely_drafts()), CONTEXT)
    assert stat < _chi2_crit(dof), f"chi2 {stat:.1f} over {dof} dof"


def test_wrong_acceptance_rules_fail_the_same_check() -> None:
    torch.manual_seed(0)
    stat, dof = _pair_stat(*_two_tokens(_accept_then_resample_from_p, CONTEXT, _likely_drafts()), CONTEXT)
    assert stat > _chi2_crit(dof), f"a wrong rule passed: chi2 {stat:.1f} over {dof} dof"


def test_always_accepting_fails_the_check() -> None:
    def always(logits, chains):
        drafts = torch.tensor([*_likely_drafts(), 0]).expand(SAMPLES, 3)
        return _Fake(torch.full((SAMPLES,), 2), drafts)

    stat, dof = _pair_stat(*_two_tokens(always, CONTEXT, _likely_drafts()), CONTEXT)
    assert stat > _chi2_crit(dof), f"a wrong rule passed: chi2 {stat:.1f} over {dof} dof"


def _draft_model_step(q: torch.Tensor, rule=verify_draft_model):
    def step(logits, chains):
        drafts = torch.multinomial(q[0], SAMPLES, replacement=True)
        second = torch.multinomial(q[1], SAMPLES, replacement=True)
        tokens = torch.stack([torch.zeros_like(drafts), drafts, second], dim=1)
        ctx_logits = torch.stack([_model_logits(CONTEXT + (int(t),)) for t in range(SMALL_VOCAB)])
        # node 2's logits only matter for a third token; the test looks at the first two
        logits = torch.stack([logits[:, 0], ctx_logits[drafts], ctx_logits[drafts]], dim=1)
        chains = DraftTrees.chains(tokens, [3] * SAMPLES)
        info = _batch_info(_sample_params(SAMPLES), [0] * SAMPLES, [])
        return rule(logits, chains, q.expand(SAMPLES, 2, SMALL_VOCAB), info)

    return step


def test_draft_model_rejection_sampling_keeps_the_target_distribution() -> None:
    # q: a draft distribution unlike p, independent of context (its second row is never what it
    # would condition on: the rule must hold for any q).
    torch.manual_seed(0)
    q = torch.softmax(torch.randn(2, SMALL_VOCAB, generator=torch.Generator().manual_seed(5)), dim=-1)
    stat, dof = _pair_stat(*_two_tokens(_draft_model_step(q), CONTEXT, [0, 0]), CONTEXT)
    assert stat < _chi2_crit(dof), f"chi2 {stat:.1f} over {dof} dof"


def test_draft_model_wrong_residual_fails() -> None:
    torch.manual_seed(0)
    q = torch.softmax(torch.randn(2, SMALL_VOCAB, generator=torch.Generator().manual_seed(5)), dim=-1)

    def no_residual(logits, chains, draft_probs, info):
        # a wrong rule: q taken as ~0 (accept whenever p(d) > 0, correct from p, not p - q)
        return verify_draft_model(logits, chains, torch.zeros_like(draft_probs) + 1e-9, info)

    stat, dof = _pair_stat(*_two_tokens(_draft_model_step(q, no_residual), CONTEXT, [0, 0]), CONTEXT)
    assert stat > _chi2_crit(dof), f"a wrong rule passed: chi2 {stat:.1f} over {dof} dof"


def test_draft_equal_to_target_accepts_everything() -> None:
    torch.manual_seed(0)
    bs, n = 64, 4
    logits = torch.randn(bs, n, VOCAB)
    params = [SamplingParams(temperature=0.9, top_p=0.95) for _ in range(bs)]
    trees = DraftTrees.chains(torch.zeros(bs, n, dtype=torch.int64), [n] * bs)
    flat, expanded, _ = process_target_logits(logits.clone(), trees, _batch_info(params, [0] * bs, []))
    p = _target_probs(flat, expanded)[0].view(bs, n, VOCAB)
    tokens = torch.cat(
        [
            torch.zeros(bs, 1, dtype=torch.int64),
            torch.multinomial(p[:, :-1].reshape(-1, VOCAB), 1).view(bs, n - 1),
        ],
        1,
    )
    result = verify_draft_model(
        logits, DraftTrees.chains(tokens, [n] * bs), p[:, :-1], _batch_info(params, [0] * bs, [])
    )
    assert (result.accept_lens == n - 1).all()


def test_draft_model_greedy_is_exact_with_an_unrelated_draft() -> None:
    gen = torch.Generator().manual_seed(2)
    bs, n = 16, 5
    logits = torch.randn(bs, n, VOCAB, generator=gen)
    q = torch.softmax(torch.randn(bs, n - 1, VOCAB, generator=gen), dim=-1)
    drafts = torch.multinomial(q.view(-1, VOCAB), 1, generator=gen).view(bs, n - 1)
    drafts[: bs // 2, 0] = torch.argmax(logits[: bs // 2, 0], dim=-1)
    tokens = torch.cat([torch.zeros(bs, 1, dtype=torch.int64), drafts], dim=1)
    params = [SamplingParams(temperature=0)] * bs
    result = verify_draft_model(
        logits, DraftTrees.chains(tokens, [n] * bs), q, _batch_info(params, [0] * bs, [])
    )
    for b in range(bs):
        want = _plain_decode(logits[b], tokens[b].tolist(), list(range(-1, n - 1)), params[b], 0, [])
        assert result.output_ids[b, : int(result.accept_lens[b]) + 1].tolist() == want


def test_penalty_counts_carry_across_verify_steps() -> None:
    """Step 2's counts are step 1's `output_token_counts_out` after `cumulate_accepted` (the
    ScheduleBatch protocol); both steps equal plain decoding under a strong frequency penalty."""
    gen = torch.Generator().manual_seed(4)
    params = SamplingParams(temperature=0, frequency_penalty=1.5, repetition_penalty=1.4)
    n = 5
    outputs: list[int] = []
    counts = None
    for _ in range(3):
        logits = torch.randn(1, n, VOCAB, generator=gen)
        chain = list(range(-1, n - 1))
        tokens = _draft_like(logits[0], [0] * n, chain, 0.9, gen)
        info = SamplingBatchInfo.from_sampling_params(
            [params], [len(outputs)], "cpu", VOCAB, frozenset({EOS})
        )
        source = OutputTokenCounts.zeros(1, VOCAB) if counts is None else OutputTokenCounts.of(counts)
        info.output_token_counts, info.output_token_counts_out = source, torch.empty(1, VOCAB)
        result = verify_tree(logits.clone(), DraftTrees.chains(torch.tensor([tokens]), [n]), info)
        cumulate_accepted(info.output_token_counts_out, result)
        counts = info.output_token_counts_out
        want = _plain_decode(logits[0], tokens, chain, params, len(outputs), outputs)
        got = result.output_ids[0, : int(result.accept_lens[0]) + 1].tolist()
        assert got == want
        outputs += got
    assert torch.equal(counts[0], torch.bincount(torch.tensor(outputs), minlength=VOCAB).float())
