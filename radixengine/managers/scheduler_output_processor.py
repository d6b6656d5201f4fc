"""Output processing (SGLang's scheduler_output_processor_mixin): a batch's sampled tokens onto
its requests, stop conditions, caching or freeing their KV, the slots of requests released while
their batch ran, and one BatchTokenIDOut per step to the detokenizer."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixengine.constrained.base_grammar_backend import no_output_message
from radixengine.managers.io_struct import (
    INIT_INCREMENTAL_DETOKENIZATION_OFFSET,
    BatchTokenIDOut,
    LogprobOutputs,
    finish_length,
)
from radixengine.managers.schedule_batch import Req, ScheduleBatch

if TYPE_CHECKING:
    from radixengine.managers.scheduler import Scheduler
    from radixengine.managers.worker_client import OverlapResult
    from radixengine.model_executor.tp_worker import GenerationBatchResult

    BatchResult = GenerationBatchResult | OverlapResult

logger = logging.getLogger("radixengine.managers.scheduler")


@dataclass
class HostResults:
    """A batch's sampled tokens on the host; the logprobs only when the batch asked for them
    (per row, or per prompt-logprob row for the input ones)."""

    next_ids: list[int]
    logprobs: list[float] | None
    invalid_rows: frozenset[int]  # rows whose logits had nothing to sample
    top_val: list[list[float]] | None = None
    top_idx: list[list[int]] | None = None
    input_logprobs: list[float] | None = None
    input_top_val: list[list[float]] | None = None
    input_top_idx: list[list[int]] | None = None


class SchedulerOutputProcessorMixin:
    def process_batch_result(self: Scheduler, batch: ScheduleBatch, result: BatchResult) -> None:
        if batch.forward_mode.is_decode():
            self.process_batch_result_decode(batch, result)
        elif batch.forward_mode.is_extend():
            self.process_batch_result_prefill(batch, result)

    def _host_results(self: Scheduler, batch: ScheduleBatch, result: BatchResult) -> HostResults:
        copy_done = getattr(result, "copy_done", None)
        if copy_done is not None:
            with self.timer.phase("wait"):
                copy_done.synchronize()  # raises if the forward failed
        invalid = frozenset()
        if result.invalid_rows is not None:
            invalid = frozenset(result.invalid_rows.nonzero().view(-1).tolist())
        res = HostResults(result.next_token_ids.tolist(), None, invalid)
        if batch.return_logprob:
            res.logprobs = _tolist(result.next_token_logprobs)
            res.top_val = _tolist(result.next_token_top_logprobs_val)
            res.top_idx = _tolist(result.next_token_top_logprobs_idx)
            res.input_logprobs = _tolist(result.input_token_logprobs)
            res.input_top_val = _tolist(result.input_top_logprobs_val)
            res.input_top_idx = _tolist(result.input_top_logprobs_idx)
        return res

    def _append_token(self: Scheduler, req: Req, token: int, res: HostResults, row: int) -> None:
        if req.sampling_params.max_new_tokens == 0:  # prefill only
            req.finished_reason = finish_length(0)
            return
        req.output_ids.append(token)
        if req.grammar is not None:
            _accept_grammar_token(req, token)
        if req.return_logprob and res.logprobs is not None:
            k = req.top_logprobs_num
            top_val = res.top_val[row][:k] if k and res.top_val is not None else None
            top_idx = res.top_idx[row][:k] if k and res.top_idx is not None else None
            req.append_output_logprobs(res.logprobs[row], top_val, top_idx)
        self.stats.num_generated_tokens += 1
        if len(req.output_ids) == 1:
            req.time_stats.first_token_time = time.perf_counter()
        req.check_finished(self.eos_token_ids, self.tokenizer)

    def _take_result(self: Scheduler, req: Req, res: HostResults, row: int, batch: ScheduleBatch) -> None:
        """Append the token sampled for `row` to `req` and finish it if it stops; a row whose
        logits had nothing to sample (all NaN or -inf) fails that request alone: a 400 when its
        grammar allowed no token, else a 500."""
        if row in res.invalid_rows:
            self._abort_invalid_row(req)
            req.time_stats.finish_time = time.perf_counter()
            # Its KV covers every token this batch computed (no new token is appended) and may
            # hold NaN: freed, not inserted.
            with req.as_prefilled_upto(int(batch.seq_lens_cpu[row])):
                self.tree_cache.cache_finished_req(req, is_insert=False)
            return
        self._append_token(req, res.next_ids[row], res, row)
        if req.finished():
            req.time_stats.finish_time = time.perf_counter()
            self.tree_cache.cache_finished_req(req)

    def _abort_invalid_row(self: Scheduler, req: Req) -> None:
        if req.grammar is not None and req.grammar.allows_no_token(self.vocab_size):
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

    def process_batch_result_prefill(self: Scheduler, batch: ScheduleBatch, result: BatchResult) -> None:
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
                self.tree_cache.cache_unfinished_req(req)
            self._pending_outputs.append(req)
        self._free_stale_slots(batch, stale)

    def process_batch_result_decode(self: Scheduler, batch: ScheduleBatch, result: BatchResult) -> None:
        res = self._host_results(batch, result)
        allocator = self.token_to_kv_pool_allocator
        allocator.free_group_begin()
        stale: list[int] = []
        for i, req in enumerate(batch.reqs):
            if req.is_retracted or req.finished():
                stale.append(i)  # overlap only: it finished (or was retracted) one step earlier
                continue
            self._take_result(req, res, i, batch)
            self._pending_outputs.append(req)
        self._free_stale_slots(batch, stale)
        allocator.free_group_end()
        self.log_decode_stats(batch)

    def _free_stale_slots(self: Scheduler, batch: ScheduleBatch, stale: list[int]) -> None:
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
        if self.page_size > 1:
            locs = locs[(slot_pos % self.page_size == 0).to(locs.device)]
        self.token_to_kv_pool_allocator.free(locs)

    # Streaming out -----------------------------------------------------------------------------

    def stream_output(self: Scheduler) -> None:
        """One BatchTokenIDOut for every request that got a token, finished or failed this step.
        Per request only what is new since its previous message (ids, logprobs): a long
        generation costs the same per step. Output ids survive retraction, so the offset does.
        A streaming request is sent its first token at once, then every `--stream-interval` tokens
        (what it was not sent waits in its output ids), and always when it finishes."""
        pending, self._pending_outputs = self._pending_outputs, []
        reqs = [r for r in dict.fromkeys(pending) if self._should_send(r)]  # once each, in order
        if reqs:
            self.io.send(_batch_token_id_out(reqs, self.server_args.enable_hierarchical_cache))

    def _should_send(self: Scheduler, req: Req) -> bool:
        if req.finished() or self.stream_interval == 1 or not req.stream:
            return True
        return len(req.output_ids) % self.stream_interval == 1


def _batch_token_id_out(reqs: list[Req], storage_counts: bool = False) -> BatchTokenIDOut:
    """What is new since each request's previous message; advances their send offsets."""
    new_ids, tails = [], []
    logprobs = LogprobOutputs() if any(r.return_logprob for r in reqs) else None
    for r in reqs:
        start = r.send_token_offset
        new_ids.append(r.output_ids[start:])
        tails.append(r.origin_input_ids[-INIT_INCREMENTAL_DETOKENIZATION_OFFSET:] if start == 0 else None)
        if logprobs is not None:
            _add_logprob_outputs(logprobs, r, start)
        r.send_token_offset = len(r.output_ids)
    return BatchTokenIDOut(
        rids=[r.rid for r in reqs],
        finished_reasons=[r.finished_reason for r in reqs],
        output_ids=new_ids,
        prompt_tail_ids=tails,
        prompt_tokens=[len(r.origin_input_ids) for r in reqs],
        cached_tokens=[r.cached_tokens for r in reqs],
        skip_special_tokens=[r.sampling_params.skip_special_tokens for r in reqs],
        no_stop_trim=[r.keeps_matched_stop for r in reqs],
        spaces_between_special_tokens=[r.sampling_params.spaces_between_special_tokens for r in reqs],
        queue_times=[_queue_time(r) for r in reqs],
        cached_tokens_storage=_cached_tokens_storage(reqs, storage_counts),
        **(logprobs.logprob_outputs() if logprobs is not None else {}),
    )


def _cached_tokens_storage(reqs: list[Req], storage_counts: bool) -> list[int]:
    """Of each request's cached tokens, those read from the storage tier (empty without one)."""
    return [min(r.storage_hit_tokens, r.cached_tokens) for r in reqs] if storage_counts else []


def _accept_grammar_token(req: Req, token: int) -> None:
    try:
        req.grammar.accept_token(token)
    except ValueError as e:  # a token the mask did not allow: fail this request alone
        logger.error("request %s: %s; aborting it", req.rid, e)
        req.abort(f"Constrained decoding failed: {e}", 500, "InternalServerError")


def _add_input_logprobs(req: Req, res: HostResults, start: int, end: int) -> None:
    if start == end or res.input_logprobs is None:
        return
    top_val = top_idx = None
    if req.top_logprobs_num and res.input_top_val is not None:
        k = req.top_logprobs_num
        top_val = [v[:k] for v in res.input_top_val[start:end]]
        top_idx = [v[:k] for v in res.input_top_idx[start:end]]
    req.add_input_logprobs(res.input_logprobs[start:end], top_val, top_idx)


def _add_logprob_outputs(out: LogprobOutputs, req: Req, start: int) -> None:
    """The request's logprobs new since output token `start` (and its prompt's, once)."""
    top = req.return_logprob and req.top_logprobs_num > 0
    out.output_token_logprobs.append(req.output_token_logprobs[start:] if req.return_logprob else None)
    out.output_top_logprobs_val.append(req.output_top_logprobs_val[start:] if top else None)
    out.output_top_logprobs_idx.append(req.output_top_logprobs_idx[start:] if top else None)
    send_input = req.return_logprob and req.input_token_logprobs is not None and not req.input_logprobs_sent
    if send_input:
        req.input_logprobs_sent = True
    out.input_token_logprobs_val.append(req.input_token_logprobs if send_input else None)
    out.input_token_logprobs_idx.append(req.origin_input_ids[req.logprob_start_len :] if send_input else None)
    out.input_top_logprobs_val.append(req.input_top_logprobs_val if send_input and top else None)
    out.input_top_logprobs_idx.append(req.input_top_logprobs_idx if send_input and top else None)


def _queue_time(req: Req) -> float | None:
    """Seconds from arrival to the first prefill batch (None if it never got one)."""
    t = req.time_stats
    return t.forward_entry_time - t.wait_queue_entry_time if t.forward_entry_time else None


def _tolist(t: torch.Tensor | None) -> list | None:
    return None if t is None else t.tolist()


def _offsets(counts: list[int] | None) -> list[int] | None:
    if counts is None:
        return None
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    return offsets
