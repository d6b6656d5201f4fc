"""Req: one generation request's state and progress (SGLang keeps it in schedule_batch.py; it
lives here to keep each file one idea)."""

from __future__ import annotations

import re
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from radixengine.constrained.base_grammar_backend import BaseGrammarObject
from radixengine.managers.io_struct import (
    finish_abort,
    finish_length,
    finish_matched_str,
    finish_matched_token,
)
from radixengine.mem_cache.base_prefix_cache import BasePrefixCache
from radixengine.mem_cache.radix_cache import TreeNode
from radixengine.sampling.sampling_params import SamplingParams
from radixengine.sampling.stop_regex import stop_regex_window
from radixengine.speculative.request_state import InflightStep, RequestSpecState

_EMPTY_INDICES = torch.empty((0,), dtype=torch.int64)


class Tokenizer(Protocol):
    """What a request uses of the tokenizer: stop strings in tokens, and the decoded tail."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


# Request ----------------------------------------------------------------------------------------


@dataclass
class TimeStats:
    wait_queue_entry_time: float = 0.0  # arrival (set once, kept across retractions)
    forward_entry_time: float = 0.0  # first admitted to a prefill batch
    first_token_time: float = 0.0
    finish_time: float = 0.0


class Req:
    """One generation request and its progress. Identity semantics (hashable by object).

    A batch line (`interactive` False: a line of /v1/batches) yields to interactive requests,
    whatever the policy and priorities: ordered after them (schedule_policy.py), admitted only
    when none waits (prefill_admission.py), retracted before them (retraction_policy.py)."""

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
        interactive: bool = True,
        lora_id: str | None = None,
    ) -> None:
        self.rid = rid
        self.origin_input_text = origin_input_text
        self.origin_input_ids = list(origin_input_ids)
        self.sampling_params = sampling_params
        self.return_logprob = return_logprob
        # Unused without return_logprob (as in SGLang); logprob_start_len -1: no prompt logprobs.
        self.top_logprobs_num = top_logprobs_num if return_logprob else 0
        self.logprob_start_len = len(self.origin_input_ids) if logprob_start_len == -1 else logprob_start_len
        self.stream = stream
        self.priority = priority
        self.routing_key = routing_key  # the tenant (fair scheduling, managers/fair_policy.py)
        self.interactive = interactive  # False: a batch line (see the class's docstring)
        self.lora_id = lora_id  # its LoRA adapter (None: the base model), its KV's radix namespace
        self.start_wait()
        self.output_ids: list[int] = []
        self._init_logprobs()
        # How many output ids (and their logprobs) stream_output has sent to the detokenizer.
        self.send_token_offset = 0
        self._clear_round_state()
        self._init_finish_state()
        self._init_cache_counters()
        self.time_stats = TimeStats()
        # Constrained decoding: the request's matcher (a Future while its grammar compiles, in
        # the scheduler's grammar queue), advanced with every output token.
        self.grammar: BaseGrammarObject | Future | None = None

    def _init_cache_counters(self) -> None:
        """What the request got from the cache, kept across retractions."""
        self.is_retracted = False
        # Once retracted or preempted (SGLang's flag): the prefix it matches again is its own
        # KV, already counted or computed, so cached_tokens stays as it was.
        self.retracted_stain = False
        self.cached_tokens = 0  # prompt tokens served from the cache (what the user is told)
        self.hit_counted_len = 0  # the radix cache's: its tokens already counted as its hit
        # Speculative decoding: verify steps run for it, and its drafter's state (kept across
        # retractions: its output ids are).
        self.spec_verify_ct = 0
        self.spec_state: RequestSpecState | None = None
        # Verify steps allocate KV ahead (all drafts, and under overlap the step in flight's
        # worst case): the row's slots cover positions [0, kv_allocated_len) (0: its seq_len).
        self.kv_allocated_len = 0
        self.spec_inflight: InflightStep | None = None
        self.storage_hit_tokens = 0  # of cached_tokens, those read from the storage tier
        self.host_hit_tokens = 0  # of cached_tokens, those loaded back from the host tier

    def start_wait(self) -> None:
        """A new wait in the queue (fair_policy.py): its start on the prefill-token clock, stamped
        at the next scheduling pass, and its scheduling passes so far."""
        self.arrival_processed_tokens: int | None = None
        self.waiting_passes = 0

    def _init_finish_state(self) -> None:
        self.finished_reason: dict | None = None
        self.to_abort = False
        self.to_abort_message = "The request was aborted."
        self.to_abort_status_code = 499
        self._stop_token_ids = frozenset(self.sampling_params.stop_token_ids or ())
        self._stop_str_max_len = max((len(s) for s in self.sampling_params.stop_strs), default=0)
        self._stop_regex_window = stop_regex_window(self.sampling_params.stop_regex_strs)
        self.matched_stop_regex = False  # finished by a stop_regex: its output is not trimmed (SGLang)

    def _clear_round_state(self) -> None:
        """No prefix, no row, no KV: a new request, or one retracted to the waiting queue."""
        # This round's prefix match and the tokens it computes KV for (origin + output,
        # truncated for a chunk); set by `init_next_round_input` and the admission plan.
        self.fill_ids: list[int] = []
        self.prefix_indices: torch.Tensor = _EMPTY_INDICES
        self.last_node: TreeNode | None = None  # None: no tree, or nothing matched yet
        self.extend_input_len = 0
        self.req_pool_idx: int | None = None
        self.is_chunked = 0  # chunk batches launched and not processed yet
        self.already_computed = 0

    def _init_logprobs(self) -> None:
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

    def init_stop_str_window(self, tokenizer: Tokenizer | None) -> None:
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

    def tokens_from(self, start: int) -> list[int]:
        """Its tokens (prompt, then output) from position `start`, without copying the rest."""
        n = len(self.origin_input_ids)
        if start >= n:
            return self.output_ids[start - n :]
        return self.origin_input_ids[start:] + self.output_ids

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

    @property
    def extra_key(self) -> str | None:
        """The radix cache's namespace of the request's KV (SGLang's extra_key)."""
        return self.lora_id

    def init_next_round_input(self, tree_cache: BasePrefixCache | None = None) -> None:
        """Set fill_ids and extend_input_len for this round; with a tree cache, (re)match the
        prefix first (without one, the prefix of the last match or chunk is kept)."""
        prefix_ids = self.adjust_max_prefix_ids()
        if tree_cache is not None:
            match = tree_cache.match_prefix(prefix_ids, self.extra_key)
            self.prefix_indices, self.last_node = match.device_indices, match.last_node
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

    def check_finished(self, eos_token_ids: frozenset[int], tokenizer: Tokenizer | None = None) -> None:
        """SGLang's order: abort, length, stop token ids / EOS (all skipped under ignore_eos),
        stop strings, stop regexes. min_new_tokens is enforced by the sampler, which keeps EOS and the stop
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
        if tokenizer is not None:
            self._check_stop_text(tokenizer)

    def _check_stop_text(self, tokenizer: Tokenizer) -> None:
        """Stop strings in the decoded tail, then stop regexes in theirs (SGLang's order)."""
        params = self.sampling_params
        if self._stop_str_max_len:
            tail = tokenizer.decode(self.output_ids[-(self._stop_str_max_len + 1) :])
            for stop in params.stop_strs:
                if stop in tail:
                    self.finished_reason = finish_matched_str(stop)
                    return
        if self._stop_regex_window != 0:
            window = self._stop_regex_window
            tail = tokenizer.decode(self.output_ids if window is None else self.output_ids[-window:])
            for pattern in params.stop_regex_strs:
                if re.search(pattern, tail):
                    self.finished_reason = finish_matched_str(pattern)
                    self.matched_stop_regex = True
                    return

    @property
    def keeps_matched_stop(self) -> bool:
        """The output is not trimmed at what stopped it: no_stop_trim, or a stop_regex match."""
        return self.sampling_params.no_stop_trim or self.matched_stop_regex

    def abort(
        self,
        message: str,
        status_code: int = 400,
        err_type: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        self.finished_reason = finish_abort(message, status_code, err_type, param)

    def reset_for_retract(self) -> None:
        self._clear_round_state()
        self.is_retracted = self.retracted_stain = True
        self.kv_allocated_len, self.spec_inflight = 0, None
        if self.grammar is not None:  # its matcher, rebuilt from the output ids
            self.grammar = self.grammar.copy()
            for token in self.output_ids:
                self.grammar.accept_token(token)
        if self.input_token_logprobs is None:  # computed again from logprob_start_len
            self._input_logprobs_part, self._input_top_val_part, self._input_top_idx_part = [], [], []

    def samples_grammar(self) -> BaseGrammarObject | None:
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
