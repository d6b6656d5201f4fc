"""SamplingBatchInfo: the sampling parameters of a batch as tensors, plus flags that let the
sampler skip work no request needs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixengine.constrained.base_grammar_backend import allocate_vocab_mask, apply_vocab_mask
from radixengine.sampling.output_token_counts import OutputTokenCounts, cumulate
from radixengine.sampling.sampling_params import SamplingParams
from radixengine.utils.host_to_device import host_tensor

_SEED_MOD = 1 << 63  # seeds are folded into int64


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # float32 [bs, 1]; 1.0 for greedy rows
    top_ps: torch.Tensor  # float32 [bs]
    top_ks: torch.Tensor  # int64 [bs]; -1 resolved to vocab_size (when known); 1 = greedy
    min_ps: torch.Tensor  # float32 [bs]
    seeds: torch.Tensor | None  # int64 [bs] (0 for unseeded rows), None when no row is seeded
    steps: torch.Tensor  # int64 [bs]: tokens each request has sampled so far
    is_all_greedy: bool
    need_top_p_sampling: bool
    need_top_k_sampling: bool
    need_min_p_sampling: bool
    has_seed: bool
    vocab_size: int | None = None
    # Derived, for the sampler (computed on the host, so reading them costs no device sync):
    has_greedy: bool = False  # some (not all) rows are greedy
    max_top_k: int | None = None  # largest k among sampled rows; None = whole vocabulary
    seeded_rows: torch.Tensor | None = None  # int64 [n_seeded]: rows with a seed
    all_seeded: bool = False
    # min_new_tokens: (row, token) pairs whose logit is -inf while the row has sampled fewer than
    # its min_new_tokens (EOS ids and the request's stop_token_ids); None when no row asks.
    min_tokens_rows: torch.Tensor | None = None  # int64 [n_pairs]
    min_tokens_ids: torch.Tensor | None = None  # int64 [n_pairs]
    min_tokens_limit: torch.Tensor | None = None  # int64 [n_pairs]: the row's min_new_tokens
    # Penalties on each row's output token counts; None when no row has one.
    frequency_penalties: torch.Tensor | None = None  # float32 [bs, 1]
    presence_penalties: torch.Tensor | None = None  # float32 [bs, 1]
    repetition_penalties: torch.Tensor | None = None  # float32 [bs, 1]; None also when all are 1
    # Set per step (ScheduleBatch): where the counts come from, and the tensor this step gathers
    # them into and then adds its sampled token to.
    output_token_counts: OutputTokenCounts | None = None
    output_token_counts_out: torch.Tensor | None = None  # float32 [bs, vocab]
    # logit_bias as (row, token, bias) triples; None when no row has one.
    logit_bias_rows: torch.Tensor | None = None  # int64 [n]
    logit_bias_ids: torch.Tensor | None = None  # int64 [n]
    logit_bias_values: torch.Tensor | None = None  # float32 [n]
    # Constrained decoding, set per step (`update_regex_vocab_mask`): the packed allowed-token
    # mask, int32 [bs, ceil(vocab / 32)] filled on the host, and the rows it constrains.
    vocab_mask: torch.Tensor | None = None
    vocab_mask_rows: list[int] | None = None

    @property
    def batch_size(self) -> int:
        return self.top_ks.shape[0]

    @classmethod
    def from_sampling_params(
        cls,
        params: list[SamplingParams],
        steps: list[int],
        device: torch.device | str,
        vocab_size: int | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> SamplingBatchInfo:
        if len(params) != len(steps):
            raise ValueError(f"{len(params)} sampling params but {len(steps)} steps")
        ks = [_resolve_top_k(p.top_k, vocab_size) for p in params]
        return cls(
            temperatures=host_tensor([[p.temperature] for p in params], torch.float32, device).view(-1, 1),
            top_ps=host_tensor([p.top_p for p in params], torch.float32, device),
            top_ks=host_tensor(ks, torch.int64, device),
            min_ps=host_tensor([p.min_p for p in params], torch.float32, device),
            steps=host_tensor(steps, torch.int64, device),
            vocab_size=vocab_size,
            **_sampling_flags(params, ks, vocab_size),
            **_seeds(params, device),
            **_min_new_tokens_pairs(params, eos_token_ids, device),
            **_penalties(params, device),
            **_logit_bias_triples(params, device),
        )

    @property
    def need_penalties(self) -> bool:
        return self.frequency_penalties is not None

    def apply_min_new_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """EOS and stop tokens at -inf for the rows still short of their min_new_tokens (out of
        place, with no host sync)."""
        if self.min_tokens_rows is None:
            return logits
        rows, ids = self.min_tokens_rows, self.min_tokens_ids
        active = self.steps.index_select(0, rows) < self.min_tokens_limit
        suppressed = torch.where(active, float("-inf"), logits[rows, ids])
        return logits.index_put((rows, ids), suppressed)

    def update_regex_vocab_mask(self, grammars: list, vocab_size: int, pin_memory: bool = False) -> None:
        """Fill the mask of every row with a grammar (None: the row is not constrained this step)
        from its matcher's state, on the host."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            self.vocab_mask = self.vocab_mask_rows = None
            return
        mask = allocate_vocab_mask(len(grammars), vocab_size, pin_memory)
        kind = type(grammars[rows[0]])
        if all(type(grammars[i]) is kind for i in rows):
            kind.batch_fill_vocab_mask([grammars[i] for i in rows], mask, rows)
        else:
            for i in rows:
                grammars[i].fill_vocab_mask(mask, i)
        self.vocab_mask, self.vocab_mask_rows = mask, rows

    def apply_token_masks(self, logits: torch.Tensor) -> torch.Tensor:
        """min_new_tokens' mask, then the grammars' (SGLang's order). A row the two leave with no
        token is one whose grammar allows only its end (EOS or a stop token) before its
        min_new_tokens: the grammar wins and the request ends as its grammar does (`stop`). No
        host sync."""
        masked = self.apply_vocab_mask(self.apply_min_new_tokens(logits))
        if self.min_tokens_rows is None or self.vocab_mask is None:
            return masked
        grammar_only = self.apply_vocab_mask(logits.clone())
        return torch.where(torch.isneginf(masked).all(dim=-1, keepdim=True), grammar_only, masked)

    def apply_vocab_mask(self, logits: torch.Tensor) -> torch.Tensor:
        """The constrained rows' disallowed tokens at -inf (in place); other rows untouched."""
        if self.vocab_mask is not None:
            apply_vocab_mask(logits, self.vocab_mask, self.vocab_mask_rows)
        return logits

    def load_output_token_counts(self) -> torch.Tensor:
        """This step's output token counts (gathered into `output_token_counts_out`)."""
        if self.output_token_counts is None or self.output_token_counts_out is None:
            raise ValueError(
                "a batch with penalties needs its output token counts (set per step by ScheduleBatch)"
            )
        return self.output_token_counts.gather_into(self.output_token_counts_out)

    def cumulate_output_tokens(self, next_token_ids: torch.Tensor) -> None:
        """Count the tokens this step sampled (after `load_output_token_counts`)."""
        if self.output_token_counts_out is not None:
            cumulate(self.output_token_counts_out, next_token_ids)


def _penalties(params: list[SamplingParams], device: torch.device | str) -> dict[str, torch.Tensor]:
    if not any(p.has_penalties for p in params):
        return {}

    def column(values: list[float]) -> torch.Tensor:
        return host_tensor(values, torch.float32, device).view(-1, 1)

    repetition = [p.repetition_penalty for p in params]
    return dict(
        frequency_penalties=column([p.frequency_penalty for p in params]),
        presence_penalties=column([p.presence_penalty for p in params]),
        repetition_penalties=column(repetition) if any(r != 1.0 for r in repetition) else None,
    )


def _logit_bias_triples(params: list[SamplingParams], device: torch.device | str) -> dict[str, torch.Tensor]:
    triples = [
        (row, token, bias) for row, p in enumerate(params) for token, bias in p.logit_bias_by_id().items()
    ]
    if not triples:
        return {}
    rows, ids, values = zip(*triples)
    return dict(
        logit_bias_rows=_int64(list(rows), device),
        logit_bias_ids=_int64(list(ids), device),
        logit_bias_values=host_tensor(list(values), torch.float32, device),
    )


def _min_new_tokens_pairs(
    params: list[SamplingParams], eos_token_ids: frozenset[int], device: torch.device | str
) -> dict[str, torch.Tensor | None]:
    rows: list[int] = []
    ids: list[int] = []
    limits: list[int] = []
    for row, p in enumerate(params):
        if p.min_new_tokens <= 0:
            continue
        stops = sorted(set(p.stop_token_ids or ()) | eos_token_ids)
        rows += [row] * len(stops)
        ids += stops
        limits += [p.min_new_tokens] * len(stops)
    if not rows:
        return {}
    return dict(
        min_tokens_rows=_int64(rows, device),
        min_tokens_ids=_int64(ids, device),
        min_tokens_limit=_int64(limits, device),
    )


def _int64(values: list[int], device: torch.device | str) -> torch.Tensor:
    return host_tensor(values, torch.int64, device)


def _sampling_flags(params: list[SamplingParams], ks: list[int], vocab_size: int | None) -> dict:
    """Which sampling steps some sampled (not greedy) row needs, and the largest top-k among them."""
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    full = vocab_size if vocab_size is not None else -1
    need_top_k = any(ks[i] != full for i in sampled)
    return {
        "is_all_greedy": not sampled,
        "need_top_p_sampling": any(params[i].top_p < 1.0 for i in sampled),
        "need_top_k_sampling": need_top_k,
        "need_min_p_sampling": any(params[i].min_p > 0.0 for i in sampled),
        "has_greedy": bool(sampled) and len(sampled) < len(params),
        "max_top_k": _max_top_k([ks[i] for i in sampled], full) if need_top_k else None,
    }


def _seeds(params: list[SamplingParams], device: torch.device | str) -> dict:
    """The rows' seeds (0 for an unseeded row; None when no row is seeded) and the seeded rows."""
    seeded = [i for i, p in enumerate(params) if p.sampling_seed is not None]
    if not seeded:
        return {"seeds": None, "has_seed": False, "seeded_rows": None, "all_seeded": False}
    seeds = [0 if p.sampling_seed is None else p.sampling_seed % _SEED_MOD for p in params]
    return {
        "seeds": host_tensor(seeds, torch.int64, device),
        "has_seed": True,
        "seeded_rows": host_tensor(seeded, torch.int64, device),
        "all_seeded": len(seeded) == len(params),
    }


def _resolve_top_k(top_k: int, vocab_size: int | None) -> int:
    if vocab_size is None:
        return top_k
    return vocab_size if top_k == -1 else min(top_k, vocab_size)


def _max_top_k(ks: list[int], full: int) -> int | None:
    # None when some sampled row keeps the whole vocabulary (k == -1 or k == vocab_size).
    if not ks or full in ks or -1 in ks:
        return None
    return max(ks)
