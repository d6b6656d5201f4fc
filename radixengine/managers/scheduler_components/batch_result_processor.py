"""The batch result processor (SGLang's scheduler_output_processor): a batch's sampled tokens onto
its requests, stop conditions, caching or freeing their KV, and the slots of requests released
while their batch ran. Every request that got a token, finished or failed goes to the streamer."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixengine.constrained.base_grammar_backend import no_output_message
from radixengine.layers.forward_logprobs import ForwardLogprobs
from radixengine.managers.io_struct import finish_length
from radixengine.managers.overlap_utils import StepTimer
from radixengine.managers.req import Tokenizer
from radixengine.managers.schedule_batch import Req, ScheduleBatch
from radixengine.managers.scheduler_components.output_streamer import OutputStreamer
from radixengine.managers.scheduler_components.scheduler_stats import SchedulerStats
from radixengine.managers.scheduler_components.speculative_drafter import Drafter
from radixengine.mem_cache.allocator import BaseTokenToKVPoolAllocator
from radixengine.mem_cache.base_prefix_cache import BasePrefixCache, finished_kv_len

if TYPE_CHECKING:
    from radixengine.managers.worker_client import OverlapResult
    from radixengine.model_executor.tp_worker import GenerationBatchResult
    from radixengine.speculative.spec_verify import VerifyResult

    BatchResult = GenerationBatchResult | OverlapResult

logger = logging.getLogger("radixengine.managers.scheduler")


@dataclass
class HostResults:
    """A batch's sampled tokens on the host; the logprobs only when the batch asked for them
    (per row, or per prompt-logprob row for the input ones)."""

    next_ids: list[int]
    invalid_rows: frozenset[int]  # rows whose logits had nothing to sample
    logprobs: ForwardLogprobs[list] | None = None


LogprobEntry = tuple[float, list[float] | None, list[int] | None]  # logprob, top values, top ids


@dataclass
class VerifyLogprobs:
    """A verify step's logprobs on the host: [bs][n], and the top ones by row b * n + position."""

    logprobs: list[list[float]]
    top_val: list[list[float]] | None
    top_idx: list[list[int]] | None
    width: int

    def entry(self, req: Req, row: int, position: int) -> LogprobEntry | None:
        if not req.return_logprob:
            return None
        k, flat = req.top_logprobs_num, row * self.width + position
        top_val = self.top_val[flat][:k] if k and self.top_val is not None else None
        top_idx = self.top_idx[flat][:k] if k and self.top_idx is not None else None
        return self.logprobs[row][position], top_val, top_idx


def _verify_logprobs(batch: ScheduleBatch, v: VerifyResult) -> VerifyLogprobs | None:
    if not batch.return_logprob or v.logprobs is None:
        return None
    top = v.top_logprobs
    return VerifyLogprobs(
        v.logprobs.tolist(),
        None if top is None else top.val.tolist(),
        None if top is None else top.idx.tolist(),
        v.output_ids.shape[1],
    )


@dataclass(frozen=True)
class ResultContext:
    """What the processor reads of the engine: fixed when the scheduler is built."""

    tree_cache: BasePrefixCache
    allocator: BaseTokenToKVPoolAllocator
    page_size: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    tokenizer: Tokenizer | None


class BatchResultProcessor:
    def __init__(
        self,
        ctx: ResultContext,
        timer: StepTimer,
        stats: SchedulerStats,
        streamer: OutputStreamer,
        on_decode_batch: Callable[[ScheduleBatch], None],
        drafter: Drafter | None = None,
    ) -> None:
        self.ctx = ctx
        self.drafter = drafter
        self.timer = timer
        self.stats = stats
        self.streamer = streamer
        self.on_decode_batch = on_decode_batch  # the metrics reporter's decode log

    def process_batch_result(self, batch: ScheduleBatch, result: BatchResult) -> None:
        if batch.forward_mode.is_target_verify():
            with self.timer.phase("accept"):
                self.process_batch_result_verify(batch, result)
        elif batch.forward_mode.is_decode():
            self.process_batch_result_decode(batch, result)
        elif batch.forward_mode.is_extend():
            self.process_batch_result_prefill(batch, result)

    def process_batch_result_prefill(self, batch: ScheduleBatch, result: BatchResult) -> None:
        res = self._host_results(batch, result)
        stale: list[int] = []
        input_offsets = _offsets(batch.input_logprob_counts)
        for i, req in enumerate(batch.reqs):
            decoding = batch.is_decoding_req(i)  # a MIXED batch's decode step
            if req.is_retracted or req.finished():
                # Overlap only: retracted while this batch ran (a re-prefill holds one slot more
                # than cache_finished_req freed, its last output token's), or a decode step of a
                # request that finished one step earlier.
                if (req.is_retracted and req.output_ids) or decoding:
                    stale.append(i)
                continue
            if input_offsets is not None:
                _add_input_logprobs(req, res, input_offsets[i], input_offsets[i + 1])
            if req.is_chunked > 0:
                req.is_chunked -= 1  # a partial prefill: its token is not an output
                continue
            if req.return_logprob and not decoding:
                req.finish_input_logprobs()
            self._take_result(req, res, i, batch)
            if not req.finished() and not decoding:
                self.ctx.tree_cache.cache_unfinished_req(req)
            self.streamer.add(req)
        self._free_stale_slots(batch, stale)

    def process_batch_result_decode(self, batch: ScheduleBatch, result: BatchResult) -> None:
        res = self._host_results(batch, result)
        allocator = self.ctx.allocator
        allocator.free_group_begin()
        stale: list[int] = []
        for i, req in enumerate(batch.reqs):
            if req.is_retracted or req.finished():
                stale.append(i)  # overlap only: it finished (or was retracted) one step earlier
                continue
            self._take_result(req, res, i, batch)
            self.streamer.add(req)
        self._free_stale_slots(batch, stale)
        allocator.free_group_end()
        self.on_decode_batch(batch)

    def process_batch_result_verify(self, batch: ScheduleBatch, result: BatchResult) -> None:
        """A verify step: each request takes its accepted drafts and the bonus token one by one,
        up to a stop (the rest is dropped); the KV past what it keeps is freed, but for what a
        verify step launched after this one (overlap) may write."""
        v = self._host_verify(result)
        out_ids, accepted = v.output_ids.tolist(), v.accept_lens.tolist()
        invalid = set() if v.invalid_rows is None else set(v.invalid_rows.nonzero().view(-1).tolist())
        logprobs = _verify_logprobs(batch, v)
        nodes = getattr(result, "spec_num_nodes", None) or batch.extend_lens
        self.ctx.allocator.free_group_begin()
        for i, req in enumerate(batch.reqs):
            if req.is_retracted or req.finished():
                continue  # overlap only: released (and its KV freed) while this batch ran
            # A row whose bonus node had nothing to sample still takes its accepted drafts (their
            # nodes were fine), as plain decoding would have emitted them before failing.
            tokens = out_ids[i][: accepted[i] + (0 if i in invalid else 1)]
            if _first_draft_missed(batch, i, nodes[i]):
                self.drafter.on_verified(req, 1)
            self._take_verify_row(batch, i, tokens, logprobs, nodes[i] > 1, i in invalid)
            self.streamer.add(req)
        batch.finish_verify(
            [finished_kv_len(r) for r in batch.reqs],
            [r.output_ids[-1] if r.output_ids else 0 for r in batch.reqs],
        )
        self.ctx.allocator.free_group_end()
        self.on_decode_batch(batch)

    def _take_verify_row(
        self,
        batch: ScheduleBatch,
        i: int,
        tokens: list[int],
        logprobs: VerifyLogprobs | None,
        drafted: bool,
        invalid: bool,
    ) -> None:
        req = batch.reqs[i]
        # Its slots end at its allocation; what a later verify step in flight allocated ahead
        # for it stays (0 in the normal loop). A plain decode step launched after this one reset
        # the allocation (its slot is its own), which it does only when this step verified the
        # request's root alone, at its known KV length.
        known = finished_kv_len(req) + batch.extend_lens[i]
        end = req.kv_allocated_len or known
        emitted = self._take_verified(req, tokens, logprobs, i)
        if drafted:  # else this was its decode step
            req.spec_verify_ct += 1
            self.stats.add_spec_verify(emitted)
            self.drafter.on_verified(req, emitted)
        if invalid and not req.finished():
            self._abort_invalid_verify_row(batch, i, end)
        elif req.finished():
            batch.free_verify_tail(i, finished_kv_len(req), end)
            self._finish(req)
        else:
            batch.free_verify_tail(i, finished_kv_len(req) + end - known, end)

    def _host_verify(self, result: BatchResult) -> VerifyResult:
        copy_done = getattr(result, "copy_done", None)
        if copy_done is not None:
            with self.timer.phase("wait"):
                copy_done.synchronize()  # raises if the forward failed
        return result.verify

    def _take_verified(self, req: Req, tokens: list[int], logprobs: VerifyLogprobs | None, row: int) -> int:
        """Append the verified tokens until one finishes the request; returns how many."""
        for j, token in enumerate(tokens):
            entry = None if logprobs is None else logprobs.entry(req, row, j)
            self._append_token(req, token, entry)
            if req.finished():
                return j + 1
        return len(tokens)

    def _abort_invalid_verify_row(self, batch: ScheduleBatch, row: int, end: int) -> None:
        req = batch.reqs[row]
        self._abort_invalid_row(req)
        req.time_stats.finish_time = time.perf_counter()
        kv_len = finished_kv_len(req)
        batch.free_verify_tail(row, kv_len, end)
        with req.as_prefilled_upto(kv_len):  # the verify's KV may hold NaN: freed, not inserted
            self.ctx.tree_cache.cache_finished_req(req, is_insert=False)

    def _host_results(self, batch: ScheduleBatch, result: BatchResult) -> HostResults:
        copy_done = getattr(result, "copy_done", None)
        if copy_done is not None:
            with self.timer.phase("wait"):
                copy_done.synchronize()  # raises if the forward failed
        invalid = frozenset()
        tokens = result.next_token_ids.tolist()
        if result.invalid_rows is not None:  # a flag per row (a GPU sampler always sends it)
            invalid = frozenset(i for i, bad in enumerate(result.invalid_rows.tolist()) if bad)
        res = HostResults(tokens, invalid)
        if batch.return_logprob and result.logprobs is not None:
            res.logprobs = result.logprobs.tolist()
        return res

    def _take_result(self, req: Req, res: HostResults, row: int, batch: ScheduleBatch) -> None:
        """Append the token sampled for `row` to `req` and finish it if it stops; a row whose
        logits had nothing to sample (all NaN or -inf) fails that request alone: a 400 when its
        grammar allowed no token, else a 500."""
        if row in res.invalid_rows:
            self._abort_invalid_row(req)
            req.time_stats.finish_time = time.perf_counter()
            # Its KV covers every token this batch computed (no new token is appended) and may
            # hold NaN: freed, not inserted.
            kv_len = int(batch.seq_lens_cpu[row])
            self._free_ahead(req, kv_len)
            with req.as_prefilled_upto(kv_len):
                self.ctx.tree_cache.cache_finished_req(req, is_insert=False)
            return
        self._append_token(req, res.next_ids[row], _logprob_entry(req, res.logprobs, row))
        if req.finished():
            self._finish(req)

    def _finish(self, req: Req) -> None:
        req.time_stats.finish_time = time.perf_counter()
        self._free_ahead(req, finished_kv_len(req))
        self.ctx.tree_cache.cache_finished_req(req)
        if self.drafter is not None:
            self.drafter.on_finished(req)

    def _free_ahead(self, req: Req, kv_len: int) -> None:
        """A request released here: the slots a verify step launched after this batch allocated
        for it past its KV (overlap; whole pages past the one holding position kv_len - 1)."""
        page = self.ctx.page_size
        start, end = -(-kv_len // page) * page, req.kv_allocated_len
        if start < end:
            row = self.ctx.tree_cache.req_to_token_pool.req_to_token[req.req_pool_idx, start:end]
            self.ctx.allocator.free(row.to(torch.int64))
        req.kv_allocated_len = 0

    def _append_token(self, req: Req, token: int, logprob: LogprobEntry | None) -> None:
        if req.sampling_params.max_new_tokens == 0:  # prefill only
            req.finished_reason = finish_length(0)
            return
        req.output_ids.append(token)
        if req.grammar is not None:
            _accept_grammar_token(req, token)
        if logprob is not None:
            req.append_output_logprobs(*logprob)
        self.stats.add_generated()
        if len(req.output_ids) == 1:
            req.time_stats.first_token_time = time.perf_counter()
        req.check_finished(self.ctx.eos_token_ids, self.ctx.tokenizer)

    def _abort_invalid_row(self, req: Req) -> None:
        if req.grammar is not None and req.grammar.allows_no_token(self.ctx.vocab_size):
            kind = req.sampling_params.grammar_key[0]
            logger.info("request %s: its %s allows no next token; aborting it", req.rid, kind)
            req.abort(no_output_message(kind, len(req.output_ids)), 400, "BadRequestError", kind)
            return
        logger.error("request %s: the model's logits are all NaN or -inf; aborting it", req.rid)
        req.abort(
            "The model produced no finite logits (all NaN or -inf) for this request.",
            500,
            "InternalServerError",
        )

    def _free_stale_slots(self, batch: ScheduleBatch, stale: list[int]) -> None:
        """Free the one slot this batch allocated for each request that was already released:
        with pages, only when that slot opened a page of its own (else the page went with the
        request's last page)."""
        if not stale:
            return
        idx = torch.tensor(stale, dtype=torch.int64)
        slot_pos = batch.seq_lens_cpu[idx] - 1
        if batch.forward_mode.is_extend():  # each request's last new token
            last = torch.tensor(batch.extend_lens, dtype=torch.int64).cumsum(0) - 1
            locs = batch.out_cache_loc[last[idx].to(batch.out_cache_loc.device)]
        else:
            locs = batch.out_cache_loc[idx.to(batch.out_cache_loc.device)]
        if self.ctx.page_size > 1:
            locs = locs[(slot_pos % self.ctx.page_size == 0).to(locs.device)]
        self.ctx.allocator.free(locs)


def _accept_grammar_token(req: Req, token: int) -> None:
    try:
        req.grammar.accept_token(token)
    except ValueError as e:  # a token the mask did not allow: fail this request alone
        logger.error("request %s: %s; aborting it", req.rid, e)
        req.abort(f"Constrained decoding failed: {e}", 500, "InternalServerError")


def _logprob_entry(req: Req, lp: ForwardLogprobs[list] | None, row: int) -> LogprobEntry | None:
    """What the request is told of the token sampled for `row`, if it asked for logprobs."""
    if not req.return_logprob or lp is None or lp.next_token_logprobs is None:
        return None
    k = req.top_logprobs_num
    top_val = (
        lp.next_token_top_logprobs_val[row][:k] if k and lp.next_token_top_logprobs_val is not None else None
    )
    top_idx = (
        lp.next_token_top_logprobs_idx[row][:k] if k and lp.next_token_top_logprobs_idx is not None else None
    )
    return lp.next_token_logprobs[row], top_val, top_idx


def _add_input_logprobs(req: Req, res: HostResults, start: int, end: int) -> None:
    lp = res.logprobs
    if start == end or lp is None or lp.input_token_logprobs is None:
        return
    top_val = top_idx = None
    if req.top_logprobs_num and lp.input_top_logprobs_val is not None:
        k = req.top_logprobs_num
        top_val = [v[:k] for v in lp.input_top_logprobs_val[start:end]]
        top_idx = [v[:k] for v in lp.input_top_logprobs_idx[start:end]]
    req.add_input_logprobs(lp.input_token_logprobs[start:end], top_val, top_idx)


def _offsets(counts: list[int] | None) -> list[int] | None:
    if counts is None:
        return None
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    return offsets


def _first_draft_missed(batch: ScheduleBatch, i: int, nodes: int) -> bool:
    """Overlap: row i's drafts were dropped because the step before it emitted another bonus than
    the drafter's first token (a miss of that token; a miss inside the drafts of the step before
    is that step's own verify result)."""
    future = batch.future_verify
    return nodes == 1 and batch.extend_lens[i] > 1 and future is not None and future.expects_bonus_only[i]
