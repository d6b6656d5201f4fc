"""Req and ScheduleBatch: a request's state and the batches built from it.

A `ScheduleBatch` is the scheduler's view of a batch (the requests, plus CPU and device tensors
kept in step with them); `get_model_worker_batch` turns it into the `ModelWorkerBatch` the model
worker runs. The per-step work is vectorized over the batch; per-request Python loops are only
where a request's own list must change (prefill set-up, appending sampled tokens).

Overlap-safe by construction: tensors a launched forward may still read are never mutated in
place (`seq_lens = seq_lens + 1`, filters and merges build new tensors), and `output_ids` holds
the last sampled tokens as a device tensor (real ids, or negative FutureMap placeholders under
the overlap loop), so the next decode never waits for the host.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING, Any

import torch

from radixengine.managers.io_struct import (
    finish_abort,
    finish_length,
    finish_matched_str,
    finish_matched_token,
)
from radixengine.managers.retraction_policy import retraction_order
from radixengine.model_executor.forward_batch_info import ForwardMode, ModelWorkerBatch
from radixengine.sampling.output_token_counts import OutputTokenCounts
from radixengine.sampling.sampling_batch_info import SamplingBatchInfo
from radixengine.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixengine.server_args import ServerArgs


_EMPTY_INDICES = torch.empty((0,), dtype=torch.int64)


# Request ----------------------------------------------------------------------------------------


@dataclass
class TimeStats:
    wait_queue_entry_time: float = 0.0  # arrival (set once, kept across retractions)
    forward_entry_time: float = 0.0  # first admitted to a prefill batch
    first_token_time: float = 0.0
    finish_time: float = 0.0


class Req:
    """One generation request and its progress. Identity semantics (hashable by object)."""

    def __init__(
        self,
        rid: str,
        origin_input_text: str | None,
        origin_input_ids: list[int],
        sampling_params: SamplingParams,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        stream: bool = False,
        priority: int | None = None,
        logprob_start_len: int = -1,
        routing_key: str | None = None,
    ) -> None:
        self.rid = rid
        self.origin_input_text = origin_input_text
        self.origin_input_ids = list(origin_input_ids)
        self.sampling_params = sampling_params
        self.return_logprob = return_logprob
        # Without return_logprob neither is used (SGLang ignores them too). logprob_start_len -1
        # means no prompt logprobs: the prompt's length.
        self.top_logprobs_num = top_logprobs_num if return_logprob else 0
        self.logprob_start_len = len(self.origin_input_ids) if logprob_start_len == -1 else logprob_start_len
        self.stream = stream
        self.priority = priority
        # Fair scheduling (managers/fair_policy.py): the tenant, and this wait's start on the
        # prefill-token clock and its scheduling passes so far.
        self.routing_key = routing_key
        self.arrival_processed_tokens: int | None = None
        self.waiting_passes = 0

        self.output_ids: list[int] = []
        # With return_logprob, per output token: the chosen token's logprob and, with
        # top_logprobs_num, the most likely tokens' logprobs and ids.
        self.output_token_logprobs: list[float] = []
        self.output_top_logprobs_val: list[list[float]] = []
        self.output_top_logprobs_idx: list[list[int]] = []
        # The prompt's, for its tokens from logprob_start_len on (the first is None: nothing
        # before it is scored), set once the whole prompt is prefilled; the parts gather the
        # chunks until then.
        self.input_token_logprobs: list[float | None] | None = None
        self.input_top_logprobs_val: list[list[float] | None] | None = None
        self.input_top_logprobs_idx: list[list[int] | None] | None = None
        self.input_logprobs_sent = False
        self._input_logprobs_part: list[float] = []
        self._input_top_val_part: list[list[float]] = []
        self._input_top_idx_part: list[list[int]] = []
        # How many output ids (and their logprobs) stream_output has sent to the detokenizer.
        self.send_token_offset = 0
        # The tokens this round computes KV for (origin + output, truncated for a chunk).
        self.fill_ids: list[int] = []
        self.prefix_indices: torch.Tensor = _EMPTY_INDICES
        self.last_node: Any = None
        self.last_matched_prefix_len = 0
        self.extend_input_len = 0
        self.host_hit_length = 0
        self.req_pool_idx: int | None = None

        self.finished_reason: dict | None = None
        self.to_abort = False
        self.to_abort_message = "The request was aborted."
        self.to_abort_status_code = 499

        self.is_chunked = 0  # chunk batches launched and not processed yet
        self.is_retracted = False
        self.retraction_count = 0
        self.cached_tokens = 0  # prompt tokens served from the cache (what the user is told)
        self.already_computed = 0
        self.time_stats = TimeStats()
        # Constrained decoding: the request's matcher (a Future while its grammar compiles, in
        # the scheduler's grammar queue), advanced with every output token.
        self.grammar: Any = None

        self._stop_token_ids = frozenset(sampling_params.stop_token_ids or ())
        self._stop_str_max_len = max((len(s) for s in sampling_params.stop_strs), default=0)

    def init_stop_str_window(self, tokenizer: Any) -> None:
        """Size the look-back for stop strings in tokens: a character may span several tokens
        (emoji, rare CJK, byte fallback), so take the most of the stop string's token count and
        its UTF-8 length (no byte-level token is empty)."""
        stops = self.sampling_params.stop_strs
        if tokenizer is None or not stops or not hasattr(tokenizer, "encode"):
            return
        self._stop_str_max_len = max(
            max(len(tokenizer.encode(s, add_special_tokens=False)), len(s.encode("utf-8"))) for s in stops
        )

    def __repr__(self) -> str:
        return f"Req(rid={self.rid!r}, input={len(self.origin_input_ids)}, output={len(self.output_ids)})"

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def finished(self) -> bool:
        return self.finished_reason is not None

    # Prefix matching ---------------------------------------------------------------------------

    def adjust_max_prefix_ids(self) -> list[int]:
        """The ids a prefix match may cover: all but the last, so at least one token is computed
        and its logits exist; while its prompt logprobs are due, none past logprob_start_len (the
        positions they come from must be computed, as in SGLang)."""
        self.fill_ids = self.origin_input_ids + self.output_ids
        return self.fill_ids[: self.max_prefix_len()]

    def max_prefix_len(self) -> int:
        """How many of origin + output ids a prefix match may cover (see adjust_max_prefix_ids)."""
        limit = len(self.origin_input_ids) + len(self.output_ids) - 1
        return min(limit, self.logprob_start_len) if self.needs_input_logprobs() else limit

    def init_next_round_input(self, tree_cache: Any = None) -> None:
        """Set fill_ids and extend_input_len for this round; with a tree cache, (re)match the
        prefix first (without one, the prefix of the last match or chunk is kept)."""
        prefix_ids = self.adjust_max_prefix_ids()
        if tree_cache is not None:
            match = tree_cache.match_prefix(prefix_ids)
            self.prefix_indices, self.last_node = match.device_indices, match.last_node
            self.last_matched_prefix_len = len(self.prefix_indices)
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    # Logprobs ----------------------------------------------------------------------------------

    def needs_input_logprobs(self) -> bool:
        return (
            self.return_logprob
            and self.input_token_logprobs is None
            and self.logprob_start_len < len(self.origin_input_ids)
        )

    def input_logprob_range(self, prefix_len: int, seq_len: int) -> tuple[int, int]:
        """The positions of this extend (over tokens prefix_len..seq_len) whose logits score a
        prompt token: from logprob_start_len to the one before the prompt's last."""
        if not self.needs_input_logprobs():
            return 0, 0
        lo = max(self.logprob_start_len, prefix_len)
        return lo, max(min(seq_len, len(self.origin_input_ids) - 1), lo)

    def add_input_logprobs(
        self, logprobs: list[float], top_val: list[list[float]] | None, top_idx: list[list[int]] | None
    ) -> None:
        self._input_logprobs_part += logprobs
        if top_val is not None:
            self._input_top_val_part += top_val
            self._input_top_idx_part += top_idx

    def finish_input_logprobs(self) -> None:
        """The prompt is prefilled: its logprobs are complete (SGLang's shape, first one None)."""
        if self.input_token_logprobs is not None:
            return
        if self.logprob_start_len >= len(self.origin_input_ids):
            self.input_token_logprobs, self.input_top_logprobs_val, self.input_top_logprobs_idx = [], [], []
            return
        self.input_token_logprobs = [None, *self._input_logprobs_part]
        self.input_top_logprobs_val = [None, *self._input_top_val_part] if self.top_logprobs_num else []
        self.input_top_logprobs_idx = [None, *self._input_top_idx_part] if self.top_logprobs_num else []
        self._input_logprobs_part, self._input_top_val_part, self._input_top_idx_part = [], [], []

    def append_output_logprobs(
        self, logprob: float, top_val: list[float] | None, top_idx: list[int] | None
    ) -> None:
        self.output_token_logprobs.append(logprob)
        if self.top_logprobs_num:
            self.output_top_logprobs_val.append(top_val)
            self.output_top_logprobs_idx.append(top_idx)

    # Finishing ---------------------------------------------------------------------------------

    def check_finished(self, eos_token_ids: frozenset[int], tokenizer: Any = None) -> None:
        """SGLang's order: abort, length, stop token ids / EOS (all skipped under ignore_eos),
        stop strings. min_new_tokens is enforced by the sampler, which keeps EOS and the stop
        token ids from being sampled before it; stop strings are checked from the first token."""
        if self.finished_reason is not None:
            return
        if self.to_abort:
            self.finished_reason = finish_abort(self.to_abort_message, self.to_abort_status_code, "Aborted")
            return
        params = self.sampling_params
        num_out = len(self.output_ids)
        if num_out >= params.max_new_tokens:
            self.finished_reason = finish_length(params.max_new_tokens)
            return
        if num_out == 0:
            return
        last = self.output_ids[-1]
        if self.grammar is not None and self.grammar.is_terminated():
            self.finished_reason = finish_matched_token(last)
            return
        if not params.ignore_eos and (last in self._stop_token_ids or last in eos_token_ids):
            self.finished_reason = finish_matched_token(last)
            return
        if self._stop_str_max_len and tokenizer is not None:
            tail = tokenizer.decode(self.output_ids[-(self._stop_str_max_len + 1) :])
            for stop in params.stop_strs:
                if stop in tail:
                    self.finished_reason = finish_matched_str(stop)
                    return

    def abort(self, message: str, status_code: int = 400, err_type: str = "BadRequestError") -> None:
        self.finished_reason = finish_abort(message, status_code, err_type)

    def reset_for_retract(self) -> None:
        self.prefix_indices = _EMPTY_INDICES
        self.last_node = None
        self.last_matched_prefix_len = 0
        self.extend_input_len = 0
        self.fill_ids = []
        self.req_pool_idx = None
        self.is_chunked = 0
        self.is_retracted = True
        self.retraction_count += 1
        self.already_computed = 0
        if self.grammar is not None:  # its matcher, rebuilt from the output ids
            self.grammar = self.grammar.copy()
            for token in self.output_ids:
                self.grammar.accept_token(token)
        if self.input_token_logprobs is None:  # computed again from logprob_start_len
            self._input_logprobs_part, self._input_top_val_part, self._input_top_idx_part = [], [], []

    def samples_grammar(self) -> Any:
        """The matcher whose mask this step's token is sampled under, or None: a request without
        a grammar, a chunk that samples no token, one finished or retracted since the batch was
        launched (its token is dropped), or a prefill-only request."""
        g = self.grammar
        if g is None or self.is_chunked > 0 or self.finished() or self.is_retracted:
            return None
        return g if self.sampling_params.max_new_tokens > 0 and not g.is_terminated() else None

    @contextmanager
    def as_prefilled_upto(self, kv_len: int):
        """Present this request to the tree cache as if its KV covered exactly the first
        `kv_len` of its tokens (for releasing a partially prefilled, aborted request through
        `cache_finished_req`, which assumes the prompt is complete)."""
        saved = self.origin_input_ids, self.output_ids
        self.origin_input_ids = (self.origin_input_ids + self.output_ids)[:kv_len]
        self.output_ids = []
        try:
            yield
        finally:
            self.origin_input_ids, self.output_ids = saved


# Batch ------------------------------------------------------------------------------------------


def _int64(values, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


@dataclass
class ScheduleBatch:
    reqs: list[Req]
    req_to_token_pool: Any
    token_to_kv_pool_allocator: Any
    tree_cache: Any
    device: torch.device | str = "cpu"
    page_size: int = 1
    vocab_size: int | None = None
    eos_token_ids: frozenset[int] = frozenset()  # suppressed until a request's min_new_tokens

    forward_mode: ForwardMode = ForwardMode.IDLE
    batch_is_full: bool = False
    input_ids: torch.Tensor | None = None
    req_pool_indices: torch.Tensor = field(default_factory=lambda: _int64([]))
    seq_lens: torch.Tensor = field(default_factory=lambda: _int64([]))  # device
    seq_lens_cpu: torch.Tensor = field(default_factory=lambda: _int64([]))
    origin_lens_cpu: torch.Tensor = field(default_factory=lambda: _int64([]))
    out_cache_loc: torch.Tensor | None = None
    # The last sampled token of each request: real ids, or -placeholders under overlap.
    output_ids: torch.Tensor | None = None
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    extend_num_tokens: int = 0
    return_logprob: bool = False
    # EXTEND, when a request asks for prompt logprobs: see ModelWorkerBatch; and how many of the
    # rows are each request's.
    input_logprob_indices: torch.Tensor | None = None
    input_logprob_token_ids: torch.Tensor | None = None
    input_logprob_counts: list[int] | None = None
    # MIXED only: how many of the requests (the last ones) run their decode step in this batch.
    num_decoding_reqs: int = 0
    # The requests' output token counts (as of the tokens in output_ids), when one has a penalty.
    output_token_counts: OutputTokenCounts | None = None
    _sampling_base: SamplingBatchInfo | None = field(default=None, repr=False)

    @classmethod
    def init_new(cls, reqs: list[Req], **kwargs) -> ScheduleBatch:
        return cls(reqs=list(reqs), return_logprob=any(r.return_logprob for r in reqs), **kwargs)

    def batch_size(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    @property
    def has_grammar(self) -> bool:
        return any(r.grammar is not None for r in self.reqs)

    def copy(self) -> ScheduleBatch:
        """A shallow copy for the overlap loop's result queue: later filters and merges of the
        running batch build new lists and tensors, so the copy keeps what was launched."""
        return dataclasses.replace(self, reqs=list(self.reqs))

    # Memory ------------------------------------------------------------------------------------

    def _evict_for(self, num_tokens: int) -> None:
        shortfall = num_tokens - self.token_to_kv_pool_allocator.available_size()
        if shortfall > 0:
            self.tree_cache.evict(shortfall)

    def _alloc_failed(self, what: str, num_tokens: int) -> RuntimeError:
        avail = self.token_to_kv_pool_allocator.available_size()
        evictable = self.tree_cache.evictable_size()
        return RuntimeError(
            f"Out of memory allocating {num_tokens} KV slots for {what} "
            f"(available {avail}, evictable {evictable}). Try a smaller batch."
        )

    def _alloc_req_rows(self) -> list[int]:
        rows: list[int | None] = [r.req_pool_idx for r in self.reqs]  # a chunked req keeps its row
        need = sum(1 for x in rows if x is None)
        fresh = self.req_to_token_pool.alloc(need) if need else []
        if fresh is None:
            raise RuntimeError(
                f"No free request rows for {need} requests (available "
                f"{self.req_to_token_pool.available_size()}); lower --max-running-requests."
            )
        it = iter(fresh)
        return [x if x is not None else next(it) for x in rows]

    def _alloc_extend_slots(self, prefix_lens: list[int], seq_lens: list[int]) -> torch.Tensor:
        n = self.extend_num_tokens
        allocator = self.token_to_kv_pool_allocator
        if self.page_size == 1:
            self._evict_for(n)
            out = allocator.alloc(n)
        else:
            self._evict_for(n + len(self.reqs) * self.page_size)
            last_loc = _int64(
                [int(r.prefix_indices[-1]) if p > 0 else -1 for r, p in zip(self.reqs, prefix_lens)],
                self.device,
            )
            out = allocator.alloc_extend(
                _int64(prefix_lens, self.device),
                _int64(seq_lens, self.device),
                last_loc,
                n,
                prefix_lens_cpu=_int64(prefix_lens),
                seq_lens_cpu=_int64(seq_lens),
            )
        if out is None:
            raise self._alloc_failed("prefill", n)
        return out

    # Prefill -----------------------------------------------------------------------------------

    def prepare_for_extend(self) -> None:
        self.forward_mode = ForwardMode.EXTEND
        reqs = self.reqs
        prefix_lens = [len(r.prefix_indices) for r in reqs]
        extend_lens = [r.extend_input_len for r in reqs]
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        self.prefix_lens, self.extend_lens = prefix_lens, extend_lens
        self.extend_num_tokens = sum(extend_lens)
        input_ids = list(chain.from_iterable(r.fill_ids[p:] for r, p in zip(reqs, prefix_lens)))

        rows = self._alloc_req_rows()
        out_cache_loc = self._alloc_extend_slots(prefix_lens, seq_lens)
        pool = self.req_to_token_pool
        now = time.perf_counter()
        pt = 0
        for req, row, pre, seq in zip(reqs, rows, prefix_lens, seq_lens):
            req.req_pool_idx = row
            if pre:
                pool.write((row, slice(0, pre)), req.prefix_indices)
            pool.write((row, slice(pre, seq)), out_cache_loc[pt : pt + seq - pre])
            pt += seq - pre
            req.cached_tokens += max(pre - req.already_computed, 0)
            req.already_computed = seq
            req.is_retracted = False
            if not req.time_stats.forward_entry_time:
                req.time_stats.forward_entry_time = now

        self.input_ids = _int64(input_ids, self.device)
        self.req_pool_indices = _int64(rows, self.device)
        self.seq_lens_cpu = _int64(seq_lens)
        self.seq_lens = self.seq_lens_cpu.to(self.device)
        self.origin_lens_cpu = _int64([len(r.origin_input_ids) for r in reqs])
        self.out_cache_loc = out_cache_loc
        self.output_ids = None
        self.output_token_counts = None
        if any(r.sampling_params.has_penalties for r in reqs):
            self.output_token_counts = OutputTokenCounts.from_output_ids(
                [r.output_ids for r in reqs], self.vocab_size, self.device
            )
        self._sampling_base = None
        self._prepare_input_logprobs(prefix_lens, seq_lens)

    def _prepare_input_logprobs(self, prefix_lens: list[int], seq_lens: list[int]) -> None:
        """The rows whose logits give prompt logprobs, for the requests that still need them."""
        self.input_logprob_indices = self.input_logprob_token_ids = self.input_logprob_counts = None
        if not self.return_logprob or not any(r.needs_input_logprobs() for r in self.reqs):
            return
        rows: list[int] = []
        targets: list[int] = []
        counts: list[int] = []
        pt = 0
        for req, pre, seq in zip(self.reqs, prefix_lens, seq_lens):
            lo, hi = req.input_logprob_range(pre, seq)
            rows.extend(range(pt + lo - pre, pt + hi - pre))
            targets.extend(req.origin_input_ids[lo + 1 : hi + 1])
            counts.append(hi - lo)
            pt += seq - pre
        self.input_logprob_indices = _int64(rows, self.device)
        self.input_logprob_token_ids = _int64(targets, self.device)
        self.input_logprob_counts = counts

    # Decode ------------------------------------------------------------------------------------

    def new_tokens_next_decode(self, selected: torch.Tensor | None = None) -> int:
        """KV slots the next decode step needs: one per request, or with pages, a whole page
        for each request whose next token starts one (seq_lens counts the KV already held, so
        the formula is the same with and without overlap)."""
        seq = self.seq_lens_cpu if selected is None else self.seq_lens_cpu[selected]
        if self.page_size == 1:
            return int(seq.numel())
        return int((seq % self.page_size == 0).sum()) * self.page_size

    def check_decode_mem(self, selected: torch.Tensor | None = None, buf_multiplier: int = 1) -> bool:
        num_tokens = self.new_tokens_next_decode(selected) * buf_multiplier
        self._evict_for(num_tokens)
        return self.token_to_kv_pool_allocator.available_size() >= num_tokens

    def mix_with_running(self, running: ScheduleBatch) -> None:
        """Append the running batch's decode step (prepared: slots allocated, seq_lens counted)
        to this prefill batch: each running request is an extend of one token over the KV it
        has (mixed chunked prefill)."""
        self.forward_mode = ForwardMode.MIXED
        bs = running.batch_size()
        self.prefix_lens = self.prefix_lens + (running.seq_lens_cpu - 1).tolist()
        self.extend_lens = self.extend_lens + [1] * bs
        self.extend_num_tokens += bs
        input_ids = torch.cat([self.input_ids, running.input_ids.to(self.device)])
        out_cache_loc = torch.cat([self.out_cache_loc, running.out_cache_loc])
        self.merge_batch(running)
        self.input_ids, self.out_cache_loc = input_ids, out_cache_loc
        self.num_decoding_reqs = bs

    def is_decoding_req(self, index: int) -> bool:
        return index >= len(self.reqs) - self.num_decoding_reqs

    def prepare_for_decode(self) -> None:
        self.forward_mode = ForwardMode.DECODE
        self.num_decoding_reqs = 0
        self.input_ids, self.output_ids = self.output_ids, None
        self.prefix_lens, self.extend_lens, self.extend_num_tokens = [], [], 0
        self.input_logprob_indices = self.input_logprob_token_ids = self.input_logprob_counts = None
        bs = len(self.reqs)
        allocator = self.token_to_kv_pool_allocator
        positions = self.seq_lens  # the new token's position, before the increment
        if self.page_size == 1:
            self._evict_for(bs)
            out = allocator.alloc(bs)
        else:
            self._evict_for(self.new_tokens_next_decode())
            last_loc = self.req_to_token_pool.req_to_token[self.req_pool_indices, positions - 1]
            out = allocator.alloc_decode(
                positions + 1, last_loc.to(torch.int64), seq_lens_cpu=self.seq_lens_cpu + 1
            )
        if out is None:
            raise self._alloc_failed("decode", bs)
        self.req_to_token_pool.write((self.req_pool_indices, positions), out.to(torch.int32))
        self.out_cache_loc = out
        # Never in place: the previous forward may still read the old tensors.
        self.seq_lens = self.seq_lens + 1
        self.seq_lens_cpu = self.seq_lens_cpu + 1

    # Composition -------------------------------------------------------------------------------

    def filter_batch(
        self,
        chunked_req_to_exclude: Req | list[Req] | None = None,
        keep_indices: list[int] | None = None,
    ) -> None:
        if keep_indices is None:
            exclude = chunked_req_to_exclude
            if exclude is None:
                exclude = []
            elif isinstance(exclude, Req):
                exclude = [exclude]
            keep_indices = [
                i for i, r in enumerate(self.reqs) if not r.finished() and not any(r is e for e in exclude)
            ]
        if len(keep_indices) == len(self.reqs):
            return
        self.num_decoding_reqs = sum(1 for i in keep_indices if self.is_decoding_req(i))
        self.reqs = [self.reqs[i] for i in keep_indices]
        idx_cpu = _int64(keep_indices)
        idx = idx_cpu.to(self.device)
        self.req_pool_indices = self.req_pool_indices[idx]
        self.seq_lens = self.seq_lens[idx]
        self.seq_lens_cpu = self.seq_lens_cpu[idx_cpu]
        self.origin_lens_cpu = self.origin_lens_cpu[idx_cpu]
        if self.output_ids is not None:
            self.output_ids = self.output_ids[idx]
        if self.output_token_counts is not None:
            penalised = any(r.sampling_params.has_penalties for r in self.reqs)
            self.output_token_counts = (
                self.output_token_counts.filter(keep_indices, self.device) if penalised else None
            )
        self.return_logprob = any(r.return_logprob for r in self.reqs)
        self._sampling_base = None

    def merge_batch(self, other: ScheduleBatch) -> None:
        if self.is_empty():
            self.reqs = []
        self.req_pool_indices = torch.cat([self.req_pool_indices.to(self.device), other.req_pool_indices])
        self.seq_lens = torch.cat([self.seq_lens.to(self.device), other.seq_lens])
        self.seq_lens_cpu = torch.cat([self.seq_lens_cpu, other.seq_lens_cpu])
        self.origin_lens_cpu = torch.cat([self.origin_lens_cpu, other.origin_lens_cpu])
        if self.output_ids is None or not self.reqs:
            self.output_ids = other.output_ids
        else:
            self.output_ids = torch.cat([self.output_ids, other.output_ids])
        self.output_token_counts = self._merged_counts(other)
        self.reqs = self.reqs + other.reqs
        self.return_logprob = self.return_logprob or other.return_logprob
        self._sampling_base = None

    def _merged_counts(self, other: ScheduleBatch) -> OutputTokenCounts | None:
        mine, theirs = self.output_token_counts, other.output_token_counts
        if not self.reqs:
            return theirs
        if mine is None and theirs is None:
            return None
        vocab = (mine or theirs).vocab_size
        mine = mine or OutputTokenCounts.zeros(len(self.reqs), vocab)  # unpenalised: counts unused
        return mine.merge(theirs or OutputTokenCounts.zeros(len(other.reqs), vocab))

    # Retraction --------------------------------------------------------------------------------

    def release_req(
        self, idx: int, remaining_req_count: int, server_args: ServerArgs, keep_prefix: bool = False
    ) -> None:
        """Return request `idx` to the waiting state: its KV is freed (not inserted: the space
        is needed now), or with `keep_prefix` (soft priority preemption) handed to the radix
        cache, evictable like any cached prefix, so what is not evicted meanwhile is reused when
        the request comes back; and room is made for the remaining requests' next steps."""
        req = self.reqs[idx]
        self.tree_cache.cache_finished_req(req, is_insert=keep_prefix)
        self._evict_for(remaining_req_count * server_args.retract_decode_steps)
        req.reset_for_retract()

    def retract_decode(self, server_args: ServerArgs) -> tuple[list[Req], float, list[Req]]:
        """Retract requests until the next decode step fits, in --retraction-policy's order
        (managers/retraction_policy.py). At least one request stays; if even it cannot get its
        next slot, it is aborted. Returns the retracted requests, the new new_token_ratio and the
        aborted."""
        order = retraction_order(self.reqs, server_args)
        retracted: list[Req] = []
        while len(order) > 1 and (not retracted or not self.check_decode_mem(_int64(order))):
            idx = order.pop()
            retracted.append(self.reqs[idx])
            self.release_req(idx, len(order), server_args)
        aborted: list[Req] = []
        if len(order) == 1 and not self.check_decode_mem(_int64(order)):
            idx = order.pop()
            req = self.reqs[idx]
            self.tree_cache.cache_finished_req(req, is_insert=False)
            req.abort(
                "Out of memory even after retracting all other requests in the decode batch: "
                "aborting the last request. Use a larger --max-total-tokens.",
                500,
                "InternalServerError",
            )
            aborted.append(req)
        self.filter_batch(keep_indices=sorted(order))
        return retracted, self._ratio_after_retract(server_args), aborted

    def _ratio_after_retract(self, server_args: ServerArgs) -> float:
        """How much of the remaining requests' max_new_tokens to reserve from now on."""
        decoded = sum(len(r.output_ids) for r in self.reqs)
        max_new = sum(r.sampling_params.max_new_tokens for r in self.reqs)
        return min(1.0, (decoded + server_args.retract_decode_steps * len(self.reqs)) / (max_new + 1))

    # Worker batch ------------------------------------------------------------------------------

    def _sampling_info(self) -> SamplingBatchInfo:
        # Tokens each request sampled before this step (a partial chunk samples nothing useful).
        steps = (self.seq_lens_cpu - self.origin_lens_cpu).clamp_(min=0)
        if self._sampling_base is None:
            self._sampling_base = SamplingBatchInfo.from_sampling_params(
                [r.sampling_params for r in self.reqs],
                steps.tolist(),
                self.device,
                self.vocab_size,
                self.eos_token_ids,
            )
            info = dataclasses.replace(self._sampling_base)  # per-step fields never reach the base
        else:
            info = dataclasses.replace(self._sampling_base, steps=steps.to(self.device))
        if self.output_token_counts is None:
            return info
        # This step gathers the counts into `out` and adds its sampled tokens to it there: `out`
        # is where the next step of these requests starts from.
        counts = self.output_token_counts
        out = torch.empty((counts.size, counts.vocab_size), dtype=torch.float32, device=self.device)
        self.output_token_counts = OutputTokenCounts.of(out)
        return dataclasses.replace(info, output_token_counts=counts, output_token_counts_out=out)

    def get_model_worker_batch(self) -> ModelWorkerBatch:
        is_extend = self.forward_mode.is_extend()
        top_logprobs_nums = None
        if self.return_logprob:
            nums = [r.top_logprobs_num for r in self.reqs]
            top_logprobs_nums = nums if any(nums) else None
        return ModelWorkerBatch(
            forward_mode=self.forward_mode,
            input_ids=self.input_ids,
            req_pool_indices=self.req_pool_indices,
            seq_lens=self.seq_lens,
            seq_lens_cpu=self.seq_lens_cpu.tolist(),
            out_cache_loc=self.out_cache_loc,
            extend_prefix_lens=list(self.prefix_lens) if is_extend else None,
            extend_seq_lens=list(self.extend_lens) if is_extend else None,
            sampling_info=self._sampling_info(),
            return_logprob=self.return_logprob,
            top_logprobs_nums=top_logprobs_nums,
            input_logprob_indices=self.input_logprob_indices if is_extend else None,
            input_logprob_token_ids=self.input_logprob_token_ids if is_extend else None,
        )
