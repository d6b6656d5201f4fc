"""STANDALONE speculative decoding: a smaller model of the same tokenizer drafts each request's
next tokens greedily, on its own KV pool, in the scheduler's process.

The draft model's KV follows each request lazily: a draft first extends it by the tokens it lacks
(the whole prompt the first time; after a verify, the accepted tokens it did not draft itself and
the bonus), which yields the first draft token, then decodes `--speculative-num-steps - 1` more.
Positions whose tokens the verify rejected are dropped before that, so the draft KV always holds
a prefix of the request's tokens. The drafts are deterministic (the draft model's argmax), so the
verify step accepts them by the target's own draws (`verify_tree`): greedy output is unchanged
and sampling keeps the target's distribution. The per-step budget is the NGRAM drafter's
(`--speculative-max-verify-tokens`); requests with a grammar take no draft. A request whose drafts
return less than they cost (`min_tokens_per_verify`, from the two models' weights) pauses
drafting as under NGRAM (speculative/spec_pacing.py); a batch where no request drafts runs no
draft forward and decodes plainly, and a request that drafts again first extends the draft KV by
the tokens it missed. A request's nodes stay within the tokens it may still emit
(`ScheduleBatch.verify_room`); one whose tokens and drafts no longer fit in the draft model's
context (shorter than the target's) stops drafting, its draft KV freed, and decodes plainly.

Under tensor parallelism rank 0 alone holds the draft model, whole (built in a one-rank group, so
its forward runs no collective beside the target's), and broadcasts its drafts: every rank then
verifies the same tokens. The other ranks' drafters have no runner; the pacing (tokens only) is
every rank's."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from radixengine.distributed import broadcast_pyobj, single_rank_group
from radixengine.layers.sampler import argmax_rows
from radixengine.managers.schedule_batch import Req, ScheduleBatch
from radixengine.model_executor.forward_batch_info import ForwardBatch, ForwardMode, ModelWorkerBatch
from radixengine.model_executor.model_runner import ModelRunner
from radixengine.speculative.spec_pacing import SpecPacing, verify_nodes_per_request
from radixengine.speculative.spec_tree import DraftTrees


@dataclass
class DraftKV:
    """A request's rows in the draft model's pools: its KV covers `tokens` (a prefix of the
    request's tokens, or drafts the next verify may reject)."""

    row: int
    tokens: list[int] = field(default_factory=list)


@dataclass
class _Context:
    """A request's tokens, followed by `extra` (tokens of a step in flight, not accepted yet)."""

    req: Req
    extra: list[int] | None = None

    @property
    def seqlen(self) -> int:
        return self.req.seqlen + len(self.extra or ())

    def tokens_from(self, start: int) -> list[int]:
        n = self.req.seqlen
        return self.req.tokens_from(min(start, n)) + list(self.extra or ())[max(start - n, 0) :]


class StandaloneDrafter:
    def __init__(
        self,
        runner: ModelRunner | None,
        num_steps: int,
        max_verify_tokens: int,
        min_tokens_per_verify: float,
        context_len: int,
    ) -> None:
        self.runner = runner  # None on a tensor-parallel rank other than 0
        self.num_steps = num_steps  # draft tokens a request proposes per step
        self.max_verify_tokens = max_verify_tokens
        self.min_tokens_per_verify = min_tokens_per_verify
        self.context_len = context_len  # the draft model's: positions its forwards may reach
        self.states: dict[int, tuple[Req, DraftKV]] = {}  # id(req) -> its draft KV
        self.pacing: dict[int, tuple[Req, SpecPacing]] = {}  # id(req) -> how its drafts fared

    def draft(self, batch: ScheduleBatch) -> DraftTrees | None:
        drafted = self._drafts(batch, [None] * batch.batch_size())
        if drafted is None:
            return None
        rows = [[r.output_ids[-1], *d] for r, d in zip(batch.reqs, drafted)]
        width = max(len(t) for t in rows)
        chains = [(np.array(t, dtype=np.int64), np.arange(-1, len(t) - 1)) for t in rows]
        return DraftTrees.from_drafts(chains, width, batch.device)

    def propose(self, batch: ScheduleBatch, extras: list[list[int] | None]) -> list[list[int]]:
        """Under the overlap loop (see SpeculativeDrafter.propose): the draft model continues each
        request's known tokens and `extra`, one token further when `extra` is given."""
        return self._drafts(batch, extras) or [[] for _ in batch.reqs]

    def _drafts(self, batch: ScheduleBatch, extras: list[list[int] | None]) -> list[list[int]] | None:
        self._release_finished()
        limit = verify_nodes_per_request(self.max_verify_tokens, batch.batch_size(), self.num_steps + 1)
        if limit == 0:
            return None
        contexts = [_Context(r, e) for r, e in zip(batch.reqs, extras)]
        self._release_past_context(c for c in contexts if not self._in_context(c, limit))
        rooms = [min(limit, room) for room in batch.verify_room()]
        drafting = [
            c
            for c, room in zip(contexts, rooms)
            if c.req.grammar is None
            and room > 1
            and self._in_context(c, limit)
            and not self._pacing_of(c.req).skips_this_step()
        ]
        if not drafting:
            return None
        drafted = None if self.runner is None else self._drafts_on_rank0(batch, extras, drafting, rooms)
        return broadcast_pyobj(drafted, src=0)

    def _drafts_on_rank0(
        self, batch: ScheduleBatch, extras: list[list[int] | None], drafting: list[_Context], rooms: list[int]
    ) -> list[list[int]] | None:
        limit = max(rooms)
        if not self._make_room(drafting, limit):
            return None
        steps = limit if any(c.extra is not None for c in drafting) else limit - 1
        with single_rank_group():
            drafted = self._run_draft_model(drafting, steps)
        # each request's nodes within its room (its root, or under overlap the predicted bonus, first)
        return [
            drafted.get(id(r), [])[: room - (1 if e is None else 0)]
            for r, e, room in zip(batch.reqs, extras, rooms)
        ]

    def _in_context(self, ctx: _Context, limit: int) -> bool:
        """Whether the draft model's forwards for this request stay inside its context (its last
        draft's position is seqlen + limit - 2 at most)."""
        return ctx.seqlen + limit - 1 <= self.context_len

    def _release_past_context(self, contexts: Iterable[_Context]) -> None:
        """Requests past the draft model's context never draft again: their draft KV goes."""
        for ctx in contexts:
            entry = self.states.pop(id(ctx.req), None)
            if entry is not None:
                self._drop(entry[1])

    def on_verified(self, req: Req, tokens: int) -> None:
        """Paces the request's drafting; the next draft drops what the verify rejected."""
        self._pacing_of(req).record(tokens)

    def on_finished(self, req: Req) -> None:
        self.pacing.pop(id(req), None)
        entry = self.states.pop(id(req), None)
        if entry is not None:
            self._drop(entry[1])

    def reset(self) -> None:
        """A cache flush: nothing outlives a request here (its draft KV goes with it)."""

    def _pacing_of(self, req: Req) -> SpecPacing:
        entry = self.pacing.get(id(req))
        if entry is None or entry[0] is not req:
            entry = self.pacing[id(req)] = (req, SpecPacing(self.min_tokens_per_verify))
        return entry[1]

    # The draft model's KV ----------------------------------------------------------------------

    def _state_of(self, req: Req) -> DraftKV:
        entry = self.states.get(id(req))
        if entry is None:
            row = self.runner.req_to_token_pool.alloc(1)[0]
            entry = self.states[id(req)] = (req, DraftKV(row))
        return entry[1]

    def _sync(self, req: _Context, state: DraftKV) -> list[int]:
        """Drop the draft KV past the longest prefix it shares with the request's tokens (never
        the last token: its logits give the first draft); returns the tokens to extend by."""
        keep = min(len(state.tokens), req.seqlen - 1)
        # Only the drafts of the last two steps can differ (one, without overlap).
        start = max(keep - 3 * (self.num_steps + 1), 0)
        for offset, token in enumerate(req.tokens_from(start)[: keep - start]):
            if state.tokens[start + offset] != token:
                keep = start + offset
                break
        self._free(state, keep)
        return req.tokens_from(keep)

    def _free(self, state: DraftKV, keep: int) -> None:
        """Free the draft KV past its first `keep` tokens."""
        if keep < len(state.tokens):
            slots = self.runner.req_to_token_pool.req_to_token[state.row, keep : len(state.tokens)]
            self.runner.token_to_kv_pool_allocator.free(slots.to(torch.int64))
            del state.tokens[keep:]

    def _drop(self, state: DraftKV) -> None:
        self._free(state, 0)
        self.runner.req_to_token_pool.free(state.row)

    def _release_finished(self) -> None:
        for key, (req, state) in list(self.states.items()):
            if req.finished():
                del self.states[key]
                self._drop(state)
        for key, (req, _) in list(self.pacing.items()):
            if req.finished():
                del self.pacing[key]

    def _fits(self, reqs: list[_Context], limit: int) -> bool:
        need = 0
        for r in reqs:
            entry = self.states.get(id(r.req))
            have = len(entry[1].tokens) if entry is not None else 0
            need += r.seqlen - have + limit
        fresh = sum(1 for r in reqs if id(r.req) not in self.states)
        runner = self.runner
        return runner.token_to_kv_pool_allocator.available_size() >= need and (
            runner.req_to_token_pool.available_size() >= fresh
        )

    def _make_room(self, reqs: list[_Context], limit: int) -> bool:
        """Rows and slots for these requests' drafts; the draft KV of requests not in the batch
        is dropped first when short (it is rebuilt when they come back)."""
        keys = {id(r.req) for r in reqs}
        for key, (_, state) in list(self.states.items()):
            if self._fits(reqs, limit):
                return True
            if key not in keys:
                del self.states[key]
                self._drop(state)
        return self._fits(reqs, limit)

    # Forwards ----------------------------------------------------------------------------------

    def _run_draft_model(self, reqs: list[_Context], steps: int) -> dict[int, list[int]]:
        states = [self._state_of(r.req) for r in reqs]
        new_tokens = [self._sync(r, s) for r, s in zip(reqs, states)]
        last = self._forward(ForwardMode.EXTEND, states, new_tokens)
        drafted = [[t] for t in last]
        for _ in range(steps - 1):
            last = self._forward(ForwardMode.DECODE, states, [[t] for t in last])
            for d, t in zip(drafted, last):
                d.append(t)
        return {id(r.req): d for r, d in zip(reqs, drafted)}

    @torch.no_grad()
    def _forward(self, mode: ForwardMode, states: list[DraftKV], new_tokens: list[list[int]]) -> list[int]:
        """One forward of the draft model over each request's new tokens; their KV slots are
        allocated and recorded; returns each request's argmax after its last token."""
        runner = self.runner
        prefix = [len(s.tokens) for s in states]
        lens = [len(t) for t in new_tokens]
        slots = runner.token_to_kv_pool_allocator.alloc(sum(lens))
        pt = 0
        for state, pre, n, toks in zip(states, prefix, lens, new_tokens):
            runner.req_to_token_pool.write((state.row, slice(pre, pre + n)), slots[pt : pt + n])
            state.tokens.extend(toks)
            pt += n
        device = runner.device
        seq = [p + n for p, n in zip(prefix, lens)]
        mwb = ModelWorkerBatch(
            forward_mode=mode,
            input_ids=torch.tensor(
                [t for toks in new_tokens for t in toks], dtype=torch.int64, device=device
            ),
            req_pool_indices=torch.tensor([s.row for s in states], dtype=torch.int64, device=device),
            seq_lens=torch.tensor(seq, dtype=torch.int64, device=device),
            seq_lens_cpu=seq,
            out_cache_loc=slots,
            extend_prefix_lens=prefix if mode.is_extend() else None,
            extend_seq_lens=lens if mode.is_extend() else None,
            sampling_info=None,
        )
        logits = runner.forward(ForwardBatch.init_new(mwb, runner)).next_token_logits
        return argmax_rows(logits).tolist()
