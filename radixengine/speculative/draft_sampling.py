"""A draft model's sampling (STANDALONE): the draft token at each draft step and the
distribution q it was drawn from, which `verify_draft_model` needs.

q is the draft model's logits put through the same pipeline the target uses at that step (the
request's penalties with the earlier drafts counted, logit_bias, min_new_tokens, temperature,
top-k / top-p / min-p), so a draft model equal to the target proposes from exactly p and every
draft is accepted. Greedy rows draft the argmax (q one-hot). Grammar rows are not drafted.
"""

from __future__ import annotations

import torch

from radixengine.layers.sampler import _sample_inverse_cdf
from radixengine.sampling.sampling_batch_info import SamplingBatchInfo
from radixengine.speculative.spec_tree import DraftTrees
from radixengine.speculative.spec_verify import _target_probs, process_target_logits


def sample_draft_step(
    draft_logits: torch.Tensor, chains: DraftTrees, step: int, info: SamplingBatchInfo
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft step `step` (node `step` proposes node `step + 1`): `draft_logits` float [bs, vocab]
    are the draft model's at node `step`; `chains` hold the root and the drafts so far (columns
    past `step` are ignored). Returns (tokens int64 [bs], q float [bs, vocab])."""
    bs, vocab = draft_logits.shape
    upto = DraftTrees.chains(chains.tokens[:, : step + 1], [step + 1] * bs)
    logits = draft_logits.new_zeros((bs, step + 1, vocab))
    logits[:, step] = draft_logits
    flat, expanded, _ = process_target_logits(logits, upto, info)
    q = _target_probs(flat, expanded)[0].view(bs, step + 1, vocab)[:, step]
    tokens = _sample_inverse_cdf(q, torch.rand(bs, device=q.device))
    return tokens, q
