"""The drafter of speculative decoding (NGRAM): before a decode step, each running request's
draft from its own n-gram index (prompt + output); the batch then runs a verify step instead.

When speculation pays (the rule, deterministic: it depends on the tokens, never on timings):
- A verify forward reads the weights once for all its tokens, so on a CPU at small batch it costs
  about one decode step; its cost grows with its tokens. The drafts share a budget of
  `max_verify_tokens` a step: each request an even share of `budget // batch size` nodes (up to
  `--speculative-num-draft-tokens`); when that leaves fewer than 3 (its last token and two
  drafts) the batch decodes plainly (`verify_nodes_per_request`). What requests drafting less
  leave goes to those whose drafts go further, the best recent record first
  (`share_verify_nodes`).
- A request whose drafts are mostly rejected (random text: fewer than
  `NGRAM_MIN_TOKENS_PER_VERIFY` tokens a verify step) pauses drafting, longer after each miss
  (speculative/spec_pacing.py), except where the step's drafts fit in `FREE_VERIFY_TOKENS`
  (batch 1 and 2 at the defaults), where a miss costs nothing (`pauses_apply`).
- A request drafts from its own tokens and from those of the other requests of the batch (as
  SGLang's NGRAM corpus takes every running request's tokens each step): requests that write the
  same text follow the one ahead; its own match wins a tie of length.
- A request's nodes never outnumber the tokens it may still emit (its max_new_tokens) nor run
  past its req_to_token row (`ScheduleBatch.verify_room`; under the overlap loop counted from the
  KV bound that includes its step in flight): near the end of its context it drafts less.
- A request with a grammar does not draft (its verify node is its decode step, under its mask);
  a batch whose requests draft nothing decodes plainly.

Under tensor parallelism every rank drafts alike: the drafts and this rule depend only on the
requests' tokens, the same on every rank (the shared index takes them at the same steps)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from radixengine.distributed import get_tp_group, single_rank_group
from radixengine.managers.schedule_batch import Req, ScheduleBatch
from radixengine.managers.scheduler_components.standalone_drafter import StandaloneDrafter
from radixengine.model_executor.model_runner import ModelRunner
from radixengine.model_loader import ModelConfig, resolve_tokenizer_path
from radixengine.server_args import ServerArgs
from radixengine.speculative.draft_model_check import check_draft_model
from radixengine.speculative.ngram_index import (
    CandidateSource,
    NgramDraft,
    NgramIndex,
    NgramParams,
    PeerCorpus,
    SharedNgramIndex,
)
from radixengine.speculative.request_state import RequestSpecState
from radixengine.speculative.spec_args import ngram_params, standalone_num_steps
from radixengine.speculative.spec_pacing import (
    NGRAM_MIN_TOKENS_PER_VERIFY,
    SpecPacing,
    draft_model_min_tokens,
    pauses_apply,
    share_verify_nodes,
    verify_nodes_per_request,
)
from radixengine.speculative.spec_tree import DraftTrees
from radixengine.utils.random_seed import preserved_random_state

logger = logging.getLogger(__name__)


class Drafter(Protocol):
    """What the scheduler asks of a drafter (NGRAM or a draft model)."""

    def draft(self, batch: ScheduleBatch) -> DraftTrees | None: ...

    def propose(self, batch: ScheduleBatch, extras: list[list[int] | None]) -> list[list[int]]: ...

    def on_verified(self, req: Req, tokens: int) -> None: ...

    def on_finished(self, req: Req) -> None: ...

    def reset(self) -> None: ...


@dataclass(frozen=True)
class DrafterConfig:
    params: NgramParams
    max_verify_tokens: int  # draft tokens (roots included) one verify step may hold


class SpeculativeDrafter:
    def __init__(self, config: DrafterConfig) -> None:
        self.config = config
        capacity = config.params.capacity
        self.shared = SharedNgramIndex(capacity) if capacity > 0 else None

    def draft(self, batch: ScheduleBatch) -> DraftTrees | None:
        """The batch's draft trees, or None when it should decode plainly."""
        share = self._limit(batch)
        if share == 0:
            return None
        peers, paced = self._peer_corpus(batch), self._paced(batch)
        full = [
            _root_only(req)
            if req.grammar is not None
            else self._draft_one(req, paced, self._sources(peers, i))
            for i, req in enumerate(batch.reqs)
        ]
        wanted = [min(d.num_nodes, room) for d, room in zip(full, batch.verify_room())]
        nodes = self._share(batch, wanted, share)
        drafts = [_trim(d, n) for d, n in zip(full, nodes)]
        width = max(d.num_nodes for d in drafts)
        if width == 1:
            return None
        return DraftTrees.from_drafts([(d.tokens, d.parents) for d in drafts], width, batch.device)

    def propose(self, batch: ScheduleBatch, extras: list[list[int] | None]) -> list[list[int]]:
        """Under the overlap loop, each request's proposed tokens: after its known tokens (extra
        None: its drafts), or after them and `extra` (the drafts of its step in flight): the
        predicted bonus of that step, then the drafts. Empty: no draft."""
        share = self._limit(batch)
        if share == 0:
            return [[] for _ in batch.reqs]
        peers, paced = self._peer_corpus(batch), self._paced(batch)
        full = [
            [] if req.grammar is not None else self._propose_one(req, extra, paced, self._sources(peers, i))
            for i, (req, extra) in enumerate(zip(batch.reqs, extras))
        ]
        # after a step in flight the first token predicts its bonus: the others are the drafts
        wanted = [
            min(1 + len(t) - (extra is not None and len(t) > 0), room)
            for t, extra, room in zip(full, extras, batch.verify_room())
        ]
        nodes = self._share(batch, wanted, share)
        return [t[: n - 1 + (extra is not None)] for t, n, extra in zip(full, nodes, extras)]

    def _peer_corpus(self, batch: ScheduleBatch) -> PeerCorpus:
        """The requests' known tokens (each index brought up to date), for the others to draft from."""
        return PeerCorpus([self._state_of(req).index.tokens for req in batch.reqs])

    def _sources(self, peers: PeerCorpus, i: int) -> list[CandidateSource]:
        """What request `i` drafts from beside its own tokens: the shared index, the batch's others."""
        others: list[CandidateSource] = [peers.of(i)] if len(peers) > 1 else []
        return others if self.shared is None else [self.shared, *others]

    def _limit(self, batch: ScheduleBatch) -> int:
        c = self.config
        return verify_nodes_per_request(c.max_verify_tokens, batch.batch_size(), c.params.num_draft_tokens)

    def _paced(self, batch: ScheduleBatch) -> bool:
        c = self.config
        return pauses_apply(batch.batch_size(), c.params.num_draft_tokens, c.max_verify_tokens)

    def _share(self, batch: ScheduleBatch, wanted: list[int], share: int) -> list[int]:
        priority = [r.spec_state.pacing.tokens_per_verify if r.spec_state else 0.0 for r in batch.reqs]
        return share_verify_nodes(wanted, priority, self.config.max_verify_tokens, share)

    def _propose_one(
        self, req: Req, extra: list[int] | None, paced: bool, sources: list[CandidateSource]
    ) -> list[int]:
        state = self._state_of(req)
        if state.pacing.skips_this_step() and paced:
            return []
        if extra is None:
            return state.index.draft(sources).tokens[1:].tolist()
        return state.index.draft_after(extra, sources).tokens[1:].tolist()

    def on_verified(self, req: Req, tokens: int) -> None:
        """A verify step gave `req` `tokens` tokens for its draft."""
        if req.spec_state is not None:
            req.spec_state.pacing.record(tokens)

    def on_finished(self, req: Req) -> None:
        """A finished request's tokens join the shared index of recent requests."""
        if self.shared is not None:
            self.shared.insert(req.origin_input_ids + req.output_ids)
        req.spec_state = None

    def reset(self) -> None:
        """A cache flush: the shared index forgets the requests it held (as SGLang's corpus)."""
        if self.shared is not None:
            self.shared = SharedNgramIndex(self.shared.capacity, self.shared.key_len)

    def _draft_one(self, req: Req, paced: bool, sources: list[CandidateSource]) -> NgramDraft:
        state = self._state_of(req)
        if state.pacing.skips_this_step() and paced:
            return _root_only(req)
        return state.index.draft(sources)

    def _state_of(self, req: Req) -> RequestSpecState:
        state = req.spec_state
        if state is None:
            index = NgramIndex(self.config.params, req.tokens_from(0))
            state = req.spec_state = RequestSpecState(index, SpecPacing(NGRAM_MIN_TOKENS_PER_VERIFY))
        elif len(state.index) < req.seqlen:
            state.index.append(req.tokens_from(len(state.index)))
        return state


def make_drafter(args: ServerArgs) -> Drafter | None:
    if args.speculative_algorithm == "NGRAM":
        return SpeculativeDrafter(DrafterConfig(ngram_params(args), args.speculative_max_verify_tokens))
    if args.speculative_algorithm == "STANDALONE":
        draft, target = draft_and_target_configs(args)
        target_tokenizer = resolve_tokenizer_path(args.model_path, args.tokenizer_path, args.revision)
        check_draft_model(draft, target, draft.hf_path, target_tokenizer)
        if draft.context_len < target.context_len:
            logger.warning(
                "the draft model's context (%d tokens) is shorter than the target's (%d): a request "
                "drafts while its tokens and drafts fit in the draft's context, then decodes plainly",
                draft.context_len,
                target.context_len,
            )
        runner = make_draft_runner(args) if get_tp_group().is_first_rank else None
        steps = standalone_num_steps(args)
        min_tokens = draft_model_min_tokens(
            draft.decode_weight_elements(), target.decode_weight_elements(), steps
        )
        return StandaloneDrafter(
            runner, steps, args.speculative_max_verify_tokens, min_tokens, draft.context_len
        )
    return None


def make_draft_runner(args: ServerArgs) -> ModelRunner:
    """The draft model, whole on this rank (under tensor parallelism rank 0 alone builds it:
    loading it must not move the random generators the ranks sample with)."""
    with single_rank_group(), preserved_random_state():
        return ModelRunner(draft_model_args(args))


def draft_and_target_configs(args: ServerArgs) -> tuple[ModelConfig, ModelConfig]:
    """Both models' configs, on every rank: the checks, the draft's context and the pacing
    threshold are every rank's, the draft model rank 0's alone."""
    draft = ModelConfig(args.speculative_draft_model_path, None, args.dtype, args.device)
    target = ModelConfig(
        args.model_path, args.context_length, args.dtype, args.device, revision=args.revision
    )
    return draft, target


def draft_model_args(args: ServerArgs) -> ServerArgs:
    """The draft model's runner: the target's device, dtype and threads; its own pools of the
    target's size (page size 1); one rank; no speculation, no CUDA graphs, no LoRA (adapters are
    the target's: the draft model drafts for every request as itself, the verify applies them)."""
    return dataclasses.replace(
        args,
        model_path=args.speculative_draft_model_path,
        tokenizer_path=None,
        revision=None,
        speculative_algorithm=None,
        speculative_draft_model_path=None,
        speculative_num_draft_tokens=None,
        page_size=1,
        tp_size=1,
        nnodes=1,
        node_rank=0,
        dist_init_addr=None,
        disable_cuda_graph=True,
        context_length=None,
        enable_lora=False,
        lora_paths=None,
    )


def _root_only(req: Req) -> NgramDraft:
    """No draft: its verify node is its decode step."""
    return NgramDraft(np.array([req.output_ids[-1]], dtype=np.int64), np.array([-1], dtype=np.int64))


def _trim(draft: NgramDraft, limit: int) -> NgramDraft:
    """The first `limit` nodes (parents come before their children, so they stay a tree)."""
    if draft.num_nodes <= limit:
        return draft
    return NgramDraft(np.asarray(draft.tokens[:limit]), np.asarray(draft.parents[:limit]))
