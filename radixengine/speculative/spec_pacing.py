"""When a request drafts: the acceptance rule both drafters share.

A request keeps the mean of the tokens its verify steps gave it (an EMA). Below the drafter's
`min_tokens_per_verify` its drafts cost more than they return: it stops drafting for
`BACKOFF_STEPS` steps, twice as long after each further miss (up to `MAX_BACKOFF_STEPS`), then
drafts once to probe (a hit resumes drafting, a miss pauses again). The rule depends on tokens
only, never on timings, so every tensor-parallel rank and every run decides the same."""

from __future__ import annotations

from dataclasses import dataclass, field

EMA_DECAY = 0.7
BACKOFF_STEPS = 8
MAX_BACKOFF_STEPS = 64
NGRAM_MIN_TOKENS_PER_VERIFY = 1.3  # a verify of a few tokens costs about a decode step
INITIAL_MARGIN = 0.3  # a new request: two misses in a row pause it
# Up to this many tokens a verify step costs a decode step (the weights are read once either way:
# at 1-16 rows the AMX linears of docs/benchmarks.md take the same time), so rejected drafts
# cost nothing there and a paused request drafts anyway.
FREE_VERIFY_TOKENS = 16
# A request verifies its last token and at least two drafts, or the batch decodes plainly: with
# one draft each a step holds twice the tokens for less than one more token a request (batch 16
# on the AMX Xeon of docs/benchmarks.md: 0.80x of plain decoding on W4 and W2).
MIN_VERIFY_NODES = 3


@dataclass
class SpecPacing:
    min_tokens_per_verify: float
    tokens_per_verify: float = field(init=False)  # the EMA
    skip_steps: int = 0  # decode steps left without drafting
    backoff: int = BACKOFF_STEPS

    def __post_init__(self) -> None:
        self.tokens_per_verify = self.min_tokens_per_verify + INITIAL_MARGIN

    def skips_this_step(self) -> bool:
        """Whether the request decodes plainly this step (counts the step)."""
        if self.skip_steps == 0:
            return False
        self.skip_steps -= 1
        return True

    def record(self, tokens: int) -> None:
        """A verify step gave the request `tokens` tokens (the bonus included) for its draft."""
        self.tokens_per_verify = EMA_DECAY * self.tokens_per_verify + (1 - EMA_DECAY) * tokens
        if self.tokens_per_verify >= self.min_tokens_per_verify:
            self.backoff = BACKOFF_STEPS
            return
        self.skip_steps = self.backoff
        self.backoff = min(2 * self.backoff, MAX_BACKOFF_STEPS)
        self.tokens_per_verify = self.min_tokens_per_verify  # after the pause one miss pauses again


def draft_model_min_tokens(draft_weights: int, target_weights: int, num_steps: int) -> float:
    """STANDALONE's threshold: a step that drafts `num_steps` tokens runs the draft model that many
    times, each costing about draft_weights / target_weights of a target decode step at small
    batch (both read their weights once a step), on top of the verify's own cost."""
    return NGRAM_MIN_TOKENS_PER_VERIFY + num_steps * draft_weights / target_weights


def verify_nodes_per_request(max_verify_tokens: int, batch_size: int, max_nodes: int) -> int:
    """The nodes (last token + drafts) each request of the batch may verify this step, within the
    step's budget and the drafter's own limit; 0: the batch decodes plainly."""
    nodes = min(max_nodes, max_verify_tokens // batch_size)
    return nodes if nodes >= min(MIN_VERIFY_NODES, max_nodes) else 0


def share_verify_nodes(
    wanted: list[int], priority: list[float], max_verify_tokens: int, share: int
) -> list[int]:
    """The nodes each request verifies this step: its `wanted` (its draft's nodes, root included)
    up to the even `share` (`verify_nodes_per_request`); what the requests that draft less leave
    of the step's budget goes to those whose drafts go further, highest `priority` (tokens per
    verify lately) first, so the step holds no more tokens while its best drafts run longer."""
    nodes = [min(w, share) for w in wanted]
    left = max_verify_tokens - sum(nodes)
    for i in sorted(range(len(wanted)), key=lambda i: -priority[i]):
        extra = max(0, min(left, wanted[i] - nodes[i]))
        nodes[i] += extra
        left -= extra
    return nodes


def pauses_apply(batch_size: int, max_nodes: int, max_verify_tokens: int) -> bool:
    """Whether a paused request skips drafting this step: not when the whole step's drafts fit in
    `FREE_VERIFY_TOKENS` tokens, where a verify costs a decode step (both read the weights once)."""
    return min(batch_size * max_nodes, max_verify_tokens) > FREE_VERIFY_TOKENS
