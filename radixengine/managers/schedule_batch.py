"""ScheduleBatch: the batches built from requests (`Req`, in req.py).

A `ScheduleBatch` is the scheduler's view of a batch (the requests, plus CPU and device tensors
kept in step with them); `get_model_worker_batch` turns it into the worker's `ModelWorkerBatch`.
Per-step work is vectorized; per-request loops only where a request's own list must change.

Overlap-safe by construction: tensors a launched forward may still read are never mutated in
place (`seq_lens = seq_lens + 1`, filters and merges build new tensors), and `output_ids` holds
the last sampled tokens as a device tensor (real ids, or negative FutureMap placeholders under
the overlap loop), so the next decode never waits for the host.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from itertools import chain

import torch

from radixengine.managers.batch_slots import BatchSlots
from radixengine.managers.batch_slots import int64_tensor as _int64
from radixengine.managers.req import Req, TimeStats
from radixengine.managers.retraction_policy import retraction_order
from radixengine.mem_cache.allocator import BaseTokenToKVPoolAllocator
from radixengine.mem_cache.base_prefix_cache import BasePrefixCache, finished_kv_len
from radixengine.mem_cache.memory_pool import ReqToTokenPool
from radixengine.model_executor.forward_batch_info import ForwardMode, ModelWorkerBatch
from radixengine.sampling.output_token_counts import OutputTokenCounts
from radixengine.sampling.sampling_batch_info import SamplingBatchInfo
from radixengine.speculative.spec_overlap import FutureVerify
from radixengine.speculative.spec_tree import DraftTrees
from radixengine.utils.host_to_device import to_device

__all__ = ["Req", "ScheduleBatch", "TimeStats"]


# Batch ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetractResult:
    retracted: list[Req]  # released, back to the waiting queue
    new_token_ratio: float  # the estimate the retraction implies
    aborted: list[Req]  # the last request, when even it could not get its next slot


@dataclass
class ScheduleBatch:
    reqs: list[Req]
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool_allocator: BaseTokenToKVPoolAllocator
    tree_cache: BasePrefixCache
    device: torch.device | str = "cpu"
    page_size: int = 1
    vocab_size: int | None = None
    eos_token_ids: frozenset[int] = frozenset()  # suppressed until a request's min_new_tokens

    forward_mode: ForwardMode = ForwardMode.IDLE
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
    # TARGET_VERIFY: the draft tree of each request (node 0: its last token).
    spec_trees: DraftTrees | None = None
    future_verify: FutureVerify | None = None  # TARGET_VERIFY under overlap: resolved on the stream
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

    @property
    def _slots(self) -> BatchSlots:
        return BatchSlots(
            self.req_to_token_pool,
            self.token_to_kv_pool_allocator,
            self.tree_cache,
            self.page_size,
            self.device,
        )

    def _evict_for(self, num_tokens: int) -> None:
        self._slots.evict_for(num_tokens)

    def _alloc_failed(self, what: str, num_tokens: int) -> RuntimeError:
        return self._slots.alloc_failed(what, num_tokens)

    def _alloc_extend_slots(
        self, prefix_lens: list[int], seq_lens: list[int], last_loc: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._slots.alloc_extend(self.reqs, prefix_lens, seq_lens, self.extend_num_tokens, last_loc)

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

        rows = self._slots.alloc_rows(self.reqs)
        out_cache_loc = self._alloc_extend_slots(prefix_lens, seq_lens)
        self._write_req_to_token(rows, prefix_lens, seq_lens, out_cache_loc)

        self.input_ids = _int64(input_ids, self.device)
        self.req_pool_indices = _int64(rows, self.device)
        self.seq_lens_cpu = _int64(seq_lens)
        self.seq_lens = to_device(self.seq_lens_cpu, self.device)
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

    def _write_req_to_token(
        self, rows: list[int], prefix_lens: list[int], seq_lens: list[int], out_cache_loc: torch.Tensor
    ) -> None:
        """Each request's row: its prefix's KV slots, then this extend's; and its cache count."""
        pool = self.req_to_token_pool
        now = time.perf_counter()
        pt = 0
        for req, row, pre, seq in zip(self.reqs, rows, prefix_lens, seq_lens):
            req.req_pool_idx = row
            if pre:
                pool.write((row, slice(0, pre)), req.prefix_indices)
            pool.write((row, slice(pre, seq)), out_cache_loc[pt : pt + seq - pre])
            pt += seq - pre
            if not req.retracted_stain:
                req.cached_tokens += max(pre - req.already_computed, 0)
            req.already_computed = seq
            req.is_retracted = False
            if not req.time_stats.forward_entry_time:
                req.time_stats.forward_entry_time = now

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
        self.spec_trees = self.future_verify = None
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

    # Speculative verify ------------------------------------------------------------------------

    def verify_slots_needed(self, num_nodes: list[int]) -> int:
        """KV slots a verify step of `num_nodes` tokens per request allocates (whole pages)."""
        prefix = self.seq_lens_cpu
        seq = prefix + _int64(num_nodes)
        if self.page_size == 1:
            return int((seq - prefix).sum())
        page = self.page_size
        return int(((seq + page - 1) // page - (prefix + page - 1) // page).sum()) * page

    def verify_room(self) -> list[int]:
        """The most nodes (root included) each request's next verify step may hold: no more than
        the tokens it may still emit (its max_new_tokens) and than its req_to_token row holds past
        its KV length (an upper bound while a step of its is in flight); at least its root."""
        width = self.req_to_token_pool.max_context_len
        rooms = []
        for req, kv_len in zip(self.reqs, self.seq_lens_cpu.tolist()):
            end = min(len(req.origin_input_ids) + req.sampling_params.max_new_tokens - 1, width)
            rooms.append(max(end - kv_len, 1))
        return rooms

    def check_verify_mem(self, trees: DraftTrees) -> bool:
        num_tokens = self.verify_slots_needed(trees.num_nodes_cpu)
        self._evict_for(num_tokens)
        return self.token_to_kv_pool_allocator.available_size() >= num_tokens

    def prepare_for_verify(self, trees: DraftTrees) -> None:
        """A verify step (speculative decoding): each request extends its KV by its draft tree,
        node 0 being its last sampled token, and every node's logits are verified."""
        self.forward_mode = ForwardMode.TARGET_VERIFY
        self.num_decoding_reqs = 0
        self.future_verify = None
        self.input_logprob_indices = self.input_logprob_token_ids = self.input_logprob_counts = None
        prefix = self.seq_lens_cpu  # the tokens with KV: all but the last sampled one
        seq = prefix + _int64(trees.num_nodes_cpu)
        self.prefix_lens, self.extend_lens = prefix.tolist(), list(trees.num_nodes_cpu)
        self.extend_num_tokens = sum(self.extend_lens)
        last_loc = None
        if self.page_size > 1:
            rows, before = self.req_pool_indices, self.seq_lens - 1
            last_loc = self.req_to_token_pool.req_to_token[rows, before.clamp(min=0)].to(torch.int64)
        out = self._alloc_extend_slots(self.prefix_lens, seq.tolist(), last_loc)
        pt = 0
        for row, pre, n in zip(self.req_pool_indices.tolist(), self.prefix_lens, self.extend_lens):
            self.req_to_token_pool.write((row, slice(pre, pre + n)), out[pt : pt + n])
            pt += n
        self.input_ids = trees.tokens[trees.valid()].to(self.device)
        self.output_ids = None
        self.out_cache_loc = out
        self.spec_trees = trees
        self.seq_lens_cpu = seq
        self.seq_lens = to_device(seq, self.device)
        for req, end in zip(self.reqs, seq.tolist()):
            req.kv_allocated_len = end

    def free_verify_tail(self, index: int, kv_keep: int, end: int | None = None) -> None:
        """Free the slots verify steps gave request `index` past its first `kv_keep` tokens
        (the rejected drafts, the accepted ones past a stop, what was allocated ahead) up to
        `end` (default: its allocation): whole pages only, the page holding position
        `kv_keep - 1` stays the request's."""
        req = self.reqs[index]
        end = req.kv_allocated_len if end is None else end
        start = -(-kv_keep // self.page_size) * self.page_size
        if start < end:
            self.token_to_kv_pool_allocator.free(
                self.req_to_token_pool.req_to_token[req.req_pool_idx, start:end].to(torch.int64)
            )
        if req.kv_allocated_len:  # 0: a plain decode step is in flight, and it counts from seq_lens
            req.kv_allocated_len = min(end, kv_keep)

    def finish_verify(self, kv_lens: list[int], last_ids: list[int]) -> None:
        """After a verify step: each request's KV length and its last sampled token (the next
        step's input)."""
        self.seq_lens_cpu = _int64(kv_lens)
        self.seq_lens = to_device(self.seq_lens_cpu, self.device)
        self.output_ids = _int64(last_ids, self.device)
        self.spec_trees = None

    # Composition -------------------------------------------------------------------------------

    def filter_batch(
        self,
        chunked_req_to_exclude: Req | list[Req] | None = None,
        keep_indices: list[int] | None = None,
    ) -> None:
        if keep_indices is None:
            keep_indices = self._unfinished_indices(chunked_req_to_exclude)
        if len(keep_indices) == len(self.reqs):
            return
        self.num_decoding_reqs = sum(1 for i in keep_indices if self.is_decoding_req(i))
        self.reqs = [self.reqs[i] for i in keep_indices]
        idx_cpu = _int64(keep_indices)
        idx = to_device(idx_cpu, self.device)
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

    def _unfinished_indices(self, exclude: Req | list[Req] | None) -> list[int]:
        if exclude is None:
            exclude = []
        elif isinstance(exclude, Req):
            exclude = [exclude]
        return [i for i, r in enumerate(self.reqs) if not r.finished() and not any(r is e for e in exclude)]

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
        self, idx: int, remaining_req_count: int, retract_decode_steps: int, keep_prefix: bool = False
    ) -> None:
        """Return request `idx` to the waiting state: its KV is freed (not inserted: the space
        is needed now), or with `keep_prefix` (soft priority preemption) handed to the radix
        cache, evictable like any cached prefix, so what is not evicted meanwhile is reused when
        the request comes back; and room is made for the remaining requests' next steps."""
        req = self.reqs[idx]
        self.free_verify_tail(idx, finished_kv_len(req))  # what verify steps allocated ahead
        self.tree_cache.cache_finished_req(req, is_insert=keep_prefix)
        self._evict_for(remaining_req_count * retract_decode_steps)
        req.reset_for_retract()

    def retract_decode(
        self,
        retract_decode_steps: int,
        retraction_policy: str = "length",
        low_priority_values_first: bool = False,
    ) -> RetractResult:
        """Retract requests until the next decode step fits, in --retraction-policy's order
        (managers/retraction_policy.py). At least one request stays; if even it cannot get its
        next slot, it is aborted."""
        order = retraction_order(self.reqs, retraction_policy, low_priority_values_first)
        retracted: list[Req] = []
        while len(order) > 1 and (not retracted or not self.check_decode_mem(_int64(order))):
            idx = order.pop()
            retracted.append(self.reqs[idx])
            self.release_req(idx, len(order), retract_decode_steps)
        aborted: list[Req] = []
        if len(order) == 1 and not self.check_decode_mem(_int64(order)):
            idx = order.pop()
            req = self.reqs[idx]
            self.free_verify_tail(idx, finished_kv_len(req))
            self.tree_cache.cache_finished_req(req, is_insert=False)
            req.abort(
                "Out of memory even after retracting all other requests in the decode batch: "
                "aborting the last request. Use a larger --max-total-tokens.",
                500,
                "InternalServerError",
            )
            aborted.append(req)
        self.filter_batch(keep_indices=sorted(order))
        return RetractResult(retracted, self._ratio_after_retract(retract_decode_steps), aborted)

    def _ratio_after_retract(self, retract_decode_steps: int) -> float:
        """How much of the remaining requests' max_new_tokens to reserve from now on."""
        decoded = sum(len(r.output_ids) for r in self.reqs)
        max_new = sum(r.sampling_params.max_new_tokens for r in self.reqs)
        return min(1.0, (decoded + retract_decode_steps * len(self.reqs)) / (max_new + 1))

    # Worker batch ------------------------------------------------------------------------------

    def _sampling_info(self) -> SamplingBatchInfo:
        # Tokens each request sampled before this step (a partial chunk samples nothing useful).
        steps = (self.seq_lens_cpu - self.origin_lens_cpu).clamp_(min=0)
        if self.spec_trees is not None:  # the root's step: the drafts are its later ones
            steps = steps - (_int64(self.spec_trees.num_nodes_cpu) - 1)
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
            info = dataclasses.replace(self._sampling_base, steps=to_device(steps, self.device))
        if self.output_token_counts is None:
            return info
        # This step gathers the counts into `out` and adds its sampled tokens to it there: `out`
        # is where the next step of these requests starts from.
        counts = self.output_token_counts
        out = torch.empty((counts.size, counts.vocab_size), dtype=torch.float32, device=self.device)
        self.output_token_counts = OutputTokenCounts.of(out)
        return dataclasses.replace(info, output_token_counts=counts, output_token_counts_out=out)

    def get_model_worker_batch(self) -> ModelWorkerBatch:
        is_extend = self.forward_mode.has_extend_layout()
        nums = [r.top_logprobs_num for r in self.reqs] if self.return_logprob else []
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
            spec_trees=self.spec_trees,
            future_verify=self.future_verify,
            lora_ids=[r.lora_id for r in self.reqs] if any(r.lora_id for r in self.reqs) else None,
        )
