"""A draft model's proposals: q is the target pipeline's distribution at that step (so a draft
equal to the target is always accepted), greedy rows draft the argmax; and the ragged verify
logits padded to [bs, n, vocab]."""

from __future__ import annotations

import torch

from radixengine.sampling.output_token_counts import OutputTokenCounts
from radixengine.sampling.sampling_batch_info import SamplingBatchInfo
from radixengine.sampling.sampling_params import SamplingParams
from radixengine.speculative.draft_sampling import sample_draft_step
from radixengine.speculative.spec_tree import DraftTrees, flatten_verify_inputs, pad_verify_logits
from radixengine.speculative.spec_verify import verify_draft_model

VOCAB = 10


def _info(params: list[SamplingParams]) -> SamplingBatchInfo:
    info = SamplingBatchInfo.from_sampling_params(params, [0] * len(params), "cpu", VOCAB)
    if info.need_penalties:
        info.output_token_counts = OutputTokenCounts.zeros(len(params), VOCAB)
        info.output_token_counts_out = torch.empty(len(params), VOCAB)
    return info


def _draft(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the draft loop with the target's own logits as the draft model's."""
    bs, n, _ = logits.shape
    tokens = torch.zeros(bs, n, dtype=torch.int64)
    qs = []
    for step in range(n - 1):
        chains = DraftTrees.chains(tokens, [n] * bs)
        tokens[:, step + 1], q = sample_draft_step(logits[:, step], chains, step, _info(params))
        qs.append(q)
    return tokens, torch.stack(qs, dim=1)


def test_draft_equal_to_target_is_always_accepted() -> None:
    torch.manual_seed(0)
    bs, n = 32, 5
    logits = torch.randn(bs, n, VOCAB) * 2
    params = [
        SamplingParams(temperature=0.8, top_k=6, frequency_penalty=0.8),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.1, top_p=0.8, min_p=0.05, presence_penalty=0.5),
        SamplingParams(temperature=0.5, logit_bias={"2": 3.0}),
    ] * (bs // 4)
    tokens, q = _draft(logits, params)
    result = verify_draft_model(logits, DraftTrees.chains(tokens, [n] * bs), q, _info(params))
    assert (result.accept_lens == n - 1).all()
    greedy = tokens[1::4]
    assert torch.equal(greedy[:, 1], torch.argmax(logits[1::4, 0], dim=-1))
    assert torch.allclose(q.sum(dim=-1), torch.ones(bs, n - 1))


def test_pad_verify_logits_follows_the_flattened_layout() -> None:
    chains = DraftTrees.chains(torch.tensor([[5, 6, 7], [8, 9, 0]]), [3, 2])
    ids, _ = flatten_verify_inputs(chains, torch.tensor([4, 4]))
    flat = torch.nn.functional.one_hot(ids, VOCAB).float()  # each row marks its own token
    padded = pad_verify_logits(flat, chains)
    assert padded.shape == (2, 3, VOCAB)
    assert torch.equal(padded.argmax(dim=-1)[0], torch.tensor([5, 6, 7]))
    assert torch.equal(padded.argmax(dim=-1)[1, :2], torch.tensor([8, 9])) and not padded[1, 2].any()
