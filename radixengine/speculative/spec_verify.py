"""Verification of draft tokens against the target's logits over the draft positions.

The target distribution at every draft node is the one plain decoding would sample from at that
point: the batch's `SamplingBatchInfo` is expanded to one row per node (`expand_sampling_info`),
node j of a request seeing the request's parameters with `steps + depth(j)` (min_new_tokens, the
seeded uniforms) and its output token counts plus the drafted tokens on the path to j
(penalties), then the sampler's own functions run on it: penalties and logit_bias, the
min_new_tokens and grammar masks, the finite check, temperature, top-k / top-p / min-p.

NGRAM drafts are deterministic (q is a point mass), so rejection sampling reduces to: draw the
target token x_j at each node exactly as the sampler would, and accept a child whose token is
x_j (`verify_tree`). Accepting d with probability p(d) and on rejection drawing from p without d
is the same law, and every emitted token is a draw from the target's conditional given the
accepted prefix. Greedy rows take the argmax, so their tokens equal plain greedy decoding; seeded
rows draw node j's uniform from (seed, step + depth), the one plain decoding uses at that step,
so a seeded request emits the very tokens it would without speculation.

A draft model (STANDALONE) proposes from its own distribution q: `verify_draft_model` accepts d
with probability min(1, p(d) / q(d)) and at the first rejection draws from max(0, p - q)
normalised (the standard rule; chains only). Greedy rows have a one-hot p, which makes the rule
exact argmax matching.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from radixengine.layers.sampler import (
    Sampler,
    TopLogprobs,
    _sample_inverse_cdf,
    _seeded_uniforms,
    _truncate,
    _uniforms,
    apply_penalties,
    argmax_rows,
    logprobs_of,
    sanitize_logits,
)
from radixengine.sampling.output_token_counts import OutputTokenCounts
from radixengine.sampling.sampling_batch_info import SamplingBatchInfo
from radixengine.speculative.spec_tree import DraftTrees

# Seeded acceptance coins use (seed, step + salt): a stream apart from the sampling uniforms.
_ACCEPT_SALT = 1 << 40
# The sampler with its finite check off (the verifier runs the check itself, per node).
_TARGET_SAMPLER = Sampler(check_finite=False)


@dataclass
class VerifyResult:
    accept_lens: torch.Tensor  # int64 [bs]: accepted draft tokens, 0 .. num_nodes - 1
    output_ids: torch.Tensor  # int64 [bs, n]: the accepted drafts, then the bonus token; -1 after
    path_nodes: torch.Tensor  # int64 [bs, n]: the node at each depth of the accepted path; -1 after
    logprobs: torch.Tensor | None = None  # float32 [bs, n]: each output id's (sampler's rule); 0 after
    top_logprobs: TopLogprobs | None = None  # rows [bs * n], row b * n + i for output position i
    invalid_rows: torch.Tensor | None = None  # bool [bs]: the bonus came from a node with nothing to sample

    @property
    def num_output_tokens(self) -> torch.Tensor:
        return self.accept_lens + 1


def verify_tree(
    logits: torch.Tensor,
    trees: DraftTrees,
    info: SamplingBatchInfo,
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
    position_vocab_mask: torch.Tensor | None = None,
) -> VerifyResult:
    """Deterministic drafts (NGRAM; chains or trees). `logits` float [bs, n, vocab]: the target's
    logits at every node (node order). Siblings with the same token count once (the first)."""
    flat, expanded, invalid = process_target_logits(logits, trees, info, position_vocab_mask)
    targets, scaled = _TARGET_SAMPLER._sample(flat, expanded)
    bs, n = trees.tokens.shape
    targets = targets.view(bs, n)
    invalid = None if invalid is None else invalid.view(bs, n)
    return _accept_targets(trees, targets, invalid, scaled, return_logprob, top_logprobs_num)


def takes_argmax_only(info: SamplingBatchInfo, return_logprob: bool) -> bool:
    """Whether every node's target is the argmax of its raw logits: greedy rows with no
    penalty, logit bias, min_new_tokens or grammar mask, and no logprobs to report."""
    return (
        info.is_all_greedy
        and not info.need_penalties
        and info.logit_bias_rows is None
        and info.min_tokens_rows is None
        and info.vocab_mask is None
        and not return_logprob
    )


def verify_tree_argmax(logits: torch.Tensor, trees: DraftTrees) -> VerifyResult | None:
    """`verify_tree` where `takes_argmax_only`, from the logits of the valid nodes alone (float
    [num valid nodes, vocab], node order) without padding them to [bs, n, vocab]: one pass over
    the logits. None when a row is not finite (NaN or inf: `verify_tree` handles it)."""
    best = argmax_rows(logits)
    if not bool(torch.isfinite(logits.gather(1, best.view(-1, 1))).all()):  # NaN counts as the max
        return None
    targets = torch.zeros(trees.tokens.shape, dtype=torch.int64, device=logits.device)
    targets[trees.valid()] = best
    return _accept_targets(trees, targets, None, logits, False, 0)


def _accept_targets(
    trees: DraftTrees,
    targets: torch.Tensor,
    invalid: torch.Tensor | None,
    scaled: torch.Tensor,
    return_logprob: bool,
    top_logprobs_num: int,
) -> VerifyResult:
    """The result of a verify whose target draw at every node is `targets` (int64 [bs, n]): the
    deepest node whose path the draws confirm, and the draw there as the bonus."""
    accepted = _accepted_nodes(trees, targets, invalid)
    depths = trees.depths()
    last = torch.argmax(accepted * (depths + 1), dim=1)
    accept_lens = depths.gather(1, last.view(-1, 1)).view(-1)
    bonus = targets.gather(1, last.view(-1, 1)).view(-1)
    path = _path_nodes(trees, last, depths)
    return _result(trees, path, accept_lens, bonus, last, scaled, invalid, return_logprob, top_logprobs_num)


def verify_draft_model(
    logits: torch.Tensor,
    trees: DraftTrees,
    draft_probs: torch.Tensor,
    info: SamplingBatchInfo,
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
) -> VerifyResult:
    """Drafts sampled from a draft model (chains). `draft_probs` float [bs, n - 1, vocab]: the
    distribution node j + 1's token was drawn from (the draft model's, after its own sampling
    parameters)."""
    if not trees.is_chain:
        raise ValueError("verify_draft_model takes chains; tree drafts with probabilities are not supported")
    flat, expanded, invalid = process_target_logits(logits, trees, info)
    bs, n = trees.tokens.shape
    p, scaled = _target_probs(flat, expanded)
    p = p.view(bs, n, -1)
    ok = _draft_model_coins(p, trees, draft_probs, expanded)
    if invalid is not None:
        invalid = invalid.view(bs, n)
        ok &= ~invalid[:, :-1]
    accept_lens = torch.cumprod(ok.to(torch.int64), dim=1).sum(dim=1)
    rows = torch.arange(bs, device=p.device)
    q_last = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)[rows, accept_lens]
    residual = (p[rows, accept_lens] - q_last).clamp_(min=0)
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p[rows, accept_lens])
    u = _uniforms(expanded, p.device).view(bs, n)[rows, accept_lens]
    bonus = _sample_inverse_cdf(residual, u)
    col = torch.arange(n, device=p.device)
    path = torch.where(col <= accept_lens.view(-1, 1), col, -1)
    return _result(
        trees, path, accept_lens, bonus, accept_lens, scaled, invalid, return_logprob, top_logprobs_num
    )


def process_target_logits(
    logits: torch.Tensor,
    trees: DraftTrees,
    info: SamplingBatchInfo,
    position_vocab_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, SamplingBatchInfo, torch.Tensor | None]:
    """(logits [bs * n, vocab] after penalties, logit_bias and the token masks, the expanded
    sampling info, the nodes with nothing to sample or None): the sampler's pipeline per node.
    Like the Sampler, float32 `logits` may be modified in place (the grammar mask)."""
    bs, n, vocab = logits.shape
    if (bs, n) != tuple(trees.tokens.shape):
        raise ValueError(f"logits for {bs} x {n} nodes, drafts of {tuple(trees.tokens.shape)}")
    expanded = expand_sampling_info(info, trees, position_vocab_mask)
    flat = logits.reshape(bs * n, vocab).float()
    flat = expanded.apply_token_masks(apply_penalties(flat, expanded))
    flat, invalid = sanitize_logits(flat)
    return flat, expanded, invalid


def expand_sampling_info(
    info: SamplingBatchInfo, trees: DraftTrees, position_vocab_mask: torch.Tensor | None = None
) -> SamplingBatchInfo:
    """One row per draft node (row b * n + j), as plain decoding would see node j's step."""
    n = trees.width
    depths = trees.depths()

    def rows(r: torch.Tensor | None) -> torch.Tensor | None:
        if r is None:
            return None
        return (r.view(-1, 1) * n + torch.arange(n, device=r.device)).reshape(-1)

    def rep(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.repeat_interleave(n, dim=0)

    return replace(
        info,
        temperatures=rep(info.temperatures),
        top_ps=rep(info.top_ps),
        top_ks=rep(info.top_ks),
        min_ps=rep(info.min_ps),
        seeds=rep(info.seeds),
        steps=rep(info.steps) + depths.reshape(-1),
        seeded_rows=rows(info.seeded_rows),
        min_tokens_rows=rows(info.min_tokens_rows),
        min_tokens_ids=rep(info.min_tokens_ids),
        min_tokens_limit=rep(info.min_tokens_limit),
        frequency_penalties=rep(info.frequency_penalties),
        presence_penalties=rep(info.presence_penalties),
        repetition_penalties=rep(info.repetition_penalties),
        logit_bias_rows=rows(info.logit_bias_rows),
        logit_bias_ids=rep(info.logit_bias_ids),
        logit_bias_values=rep(info.logit_bias_values),
        **_expanded_counts(info, trees),
        **_expanded_vocab_mask(info, trees, position_vocab_mask),
    )


def cumulate_accepted(counts: torch.Tensor | None, result: VerifyResult) -> None:
    """Add every output token of a verify step to the batch's output token counts ([bs, vocab],
    the base `SamplingBatchInfo.output_token_counts_out`), in place: the next step's source."""
    if counts is None:
        return
    ids = result.output_ids
    counts.scatter_add_(1, ids.clamp(min=0), (ids >= 0).to(counts.dtype))


def _expanded_counts(info: SamplingBatchInfo, trees: DraftTrees) -> dict:
    if not info.need_penalties:
        return {}
    bs, n = trees.tokens.shape
    base = info.load_output_token_counts()
    counts = base.repeat_interleave(n, dim=0).view(bs, n, -1)
    on_path = trees.ancestors()[:, :, 1:].to(counts.dtype)
    counts.scatter_add_(2, trees.tokens[:, None, 1:].expand(bs, n, n - 1), on_path)
    counts = counts.view(bs * n, -1)
    return dict(
        output_token_counts=OutputTokenCounts.of(counts), output_token_counts_out=torch.empty_like(counts)
    )


def _expanded_vocab_mask(
    info: SamplingBatchInfo, trees: DraftTrees, position_mask: torch.Tensor | None
) -> dict:
    if info.vocab_mask is None:
        return {}
    n = trees.width
    mask_rows = [r * n + j for r in info.vocab_mask_rows for j in range(n)]
    if position_mask is not None:
        return dict(vocab_mask=position_mask, vocab_mask_rows=mask_rows)
    drafted = [r for r in info.vocab_mask_rows if trees.num_nodes_cpu[r] > 1]
    if drafted:
        raise ValueError(
            f"rows {drafted} have a grammar and drafts: give their per-node masks (position_vocab_mask) "
            "or verify them without drafts"
        )
    return dict(vocab_mask=info.vocab_mask.repeat_interleave(n, dim=0), vocab_mask_rows=mask_rows)


def _accepted_nodes(trees: DraftTrees, targets: torch.Tensor, invalid: torch.Tensor | None) -> torch.Tensor:
    """bool [bs, n]: the nodes whose every ancestor-or-self token is the target's draw at its
    parent (the root always)."""
    parents = trees.parents.clamp(min=0)
    correct = (trees.tokens == targets.gather(1, parents)) & trees.valid()
    if invalid is not None:
        correct &= ~invalid.gather(1, parents)
    if not trees.is_chain:
        correct &= ~_repeated_siblings(trees)
    correct[:, 0] = True
    anc = trees.ancestors()
    return ~(anc & ~correct[:, None, :]).any(dim=2) & trees.valid()


def _repeated_siblings(trees: DraftTrees) -> torch.Tensor:
    """bool [bs, n]: a node with an earlier sibling of the same token."""
    n = trees.width
    earlier = torch.ones(n, n, dtype=torch.bool, device=trees.tokens.device).tril(diagonal=-1)
    same_parent = trees.parents[:, :, None] == trees.parents[:, None, :]
    same_token = trees.tokens[:, :, None] == trees.tokens[:, None, :]
    return (same_parent & same_token & earlier & trees.valid()[:, None, :]).any(dim=2)


def _path_nodes(trees: DraftTrees, last: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """int64 [bs, n]: the node at each depth of the path from the root to `last`; -1 after."""
    bs, n = trees.tokens.shape
    rows = torch.arange(bs, device=last.device)
    on_path = trees.ancestors()[rows, last]
    index = torch.where(on_path, depths, n)
    nodes = torch.arange(n, device=last.device).expand(bs, n)
    path = torch.full((bs, n + 1), -1, dtype=torch.int64, device=last.device)
    return path.scatter_(1, index, nodes)[:, :n]


def _target_probs(flat: torch.Tensor, expanded: SamplingBatchInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """(the distribution the sampler draws from at every node, normalised: one-hot argmax for
    greedy rows; the logits the logprobs are taken from)."""
    greedy = torch.nn.functional.one_hot(torch.argmax(flat, dim=-1), flat.shape[-1]).to(flat.dtype)
    if expanded.is_all_greedy:
        return greedy, flat
    scaled = flat / expanded.temperatures
    kept = _truncate(torch.softmax(scaled, dim=-1), expanded)
    probs = kept / kept.sum(dim=-1, keepdim=True)
    if expanded.has_greedy:
        probs = torch.where((expanded.top_ks == 1).view(-1, 1), greedy, probs)
    return probs, scaled


def _draft_model_coins(
    p: torch.Tensor, trees: DraftTrees, draft_probs: torch.Tensor, expanded: SamplingBatchInfo
) -> torch.Tensor:
    """bool [bs, n - 1]: draft j + 1 accepted with probability min(1, p / q) (q = 0: when p > 0)."""
    bs, n, _ = p.shape
    drafts = trees.tokens[:, 1:, None]
    p_d = p[:, :-1].gather(2, drafts).squeeze(2)
    q_d = draft_probs.gather(2, drafts).squeeze(2)
    coins = _accept_uniforms(expanded, p.device).view(bs, n)[:, 1:]
    return (coins * q_d < p_d) & trees.valid()[:, 1:]


def _accept_uniforms(info: SamplingBatchInfo, device: torch.device) -> torch.Tensor:
    u = torch.rand(info.batch_size, device=device)
    if info.has_seed:
        r = info.seeded_rows
        seeded = _seeded_uniforms(info.seeds.index_select(0, r), info.steps.index_select(0, r) + _ACCEPT_SALT)
        u.index_copy_(0, r, seeded)
    return u


def _result(
    trees: DraftTrees,
    path: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus: torch.Tensor,
    last: torch.Tensor,
    scaled: torch.Tensor,
    invalid: torch.Tensor | None,
    return_logprob: bool,
    top_logprobs_num: int,
) -> VerifyResult:
    bs, n = trees.tokens.shape
    col = torch.arange(n, device=path.device)
    drafted = torch.cat([trees.tokens.gather(1, path[:, 1:].clamp(min=0)), bonus.view(-1, 1)], dim=1)
    after = col.view(1, -1) > accept_lens.view(-1, 1)
    output_ids = torch.where(col == accept_lens.view(-1, 1), bonus.view(-1, 1), drafted).masked_fill_(
        after, -1
    )
    result = VerifyResult(accept_lens, output_ids, path)
    if invalid is not None:
        result.invalid_rows = invalid.gather(1, last.view(-1, 1)).view(-1)
    if return_logprob:
        flat_rows = (torch.arange(bs, device=path.device).view(-1, 1) * n + path.clamp(min=0)).view(-1)
        lps, top = logprobs_of(
            scaled.index_select(0, flat_rows), output_ids.clamp(min=0).view(-1), top_logprobs_num
        )
        result.logprobs = lps.view(bs, n).masked_fill_(after, 0.0)
        result.top_logprobs = top
    return result
