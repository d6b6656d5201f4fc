"""The drafter of speculative decoding (NGRAM): before a decode step, each running request's
draft from its own n-gram index (prompt + output); the batch then runs a verify step instead.

When speculation pays: a verify forward reads the weights once for all its tokens, so on a CPU at
small batch it costs about one decode step. Its tokens grow with the batch, so the drafts share a
budget of `max_verify_tokens` a step: each request drafts at most `budget // batch size` tokens
(up to `--speculative-num-draft-tokens`), and when that leaves fewer than 2 (its last token and
one draft) the batch decodes plainly. A batch with a grammar or whose requests found no match
decodes plainly too."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from radixengine.managers.schedule_batch import Req, ScheduleBatch
from radixengine.speculative.ngram_index import NgramDraft, NgramIndex, NgramParams, SharedNgramIndex
from radixengine.speculative.spec_tree import DraftTrees


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
        if batch.has_grammar:
            return None
        limit = min(self.config.params.num_draft_tokens, self.config.max_verify_tokens // batch.batch_size())
        if limit < 2:
            return None
        drafts = [_trim(self._index_of(req).draft(self.shared), limit) for req in batch.reqs]
        width = max(d.num_nodes for d in drafts)
        if width == 1:
            return None
        return DraftTrees.from_drafts([(d.tokens, d.parents) for d in drafts], width, batch.device)

    def on_finished(self, req: Req) -> None:
        """A finished request's tokens join the shared index of recent requests."""
        if self.shared is not None:
            self.shared.insert(req.origin_input_ids + req.output_ids)
        req.ngram_index = None

    def _index_of(self, req: Req) -> NgramIndex:
        total = len(req.origin_input_ids) + len(req.output_ids)
        index = req.ngram_index
        if index is None:
            index = req.ngram_index = NgramIndex(self.config.params, req.origin_input_ids + req.output_ids)
        elif len(index) < total:
            index.append(req.output_ids[len(index) - len(req.origin_input_ids) :])
        return index


def _trim(draft: NgramDraft, limit: int) -> NgramDraft:
    """The first `limit` nodes (parents come before their children, so they stay a tree)."""
    if draft.num_nodes <= limit:
        return draft
    return NgramDraft(np.asarray(draft.tokens[:limit]), np.asarray(draft.parents[:limit]))
