"""The output streamer (SGLang's stream_output): one BatchTokenIDOut a step for every request that
got a token, finished or failed in it. Per request only what is new since its previous message
(ids, logprobs): a long generation costs the same per step. Output ids survive retraction, so the
offset does. A streaming request is sent its first token at once, then every `--stream-interval`
tokens (what it was not sent waits in its output ids), and always when it finishes."""

from __future__ import annotations

from typing import Protocol

from radixengine.managers.io_struct import (
    INIT_INCREMENTAL_DETOKENIZATION_OFFSET,
    BatchTokenIDOut,
    LogprobOutputs,
)
from radixengine.managers.schedule_batch import Req


class OutputSink(Protocol):
    def send(self, msg: object) -> None: ...


class OutputStreamer:
    def __init__(
        self, sink: OutputSink, stream_interval: int, speculative: bool = False, storage_counts: bool = False
    ) -> None:
        self.sink = sink
        self.stream_interval = stream_interval
        self.speculative = speculative  # report each request's verify steps
        self.storage_counts = storage_counts  # report the cached tokens read from the storage tier
        self.pending: list[Req] = []  # requests with something to send at the end of this step
        # Every request received and not yet sent its final message, by rid (what a failed
        # step's recovery looks through).
        self.unanswered: dict[str, Req] = {}

    def expect(self, req: Req) -> None:
        """A request was received: it is owed a final message."""
        self.unanswered[req.rid] = req

    def add(self, req: Req) -> None:
        self.pending.append(req)

    def stream_output(self) -> None:
        pending, self.pending = self.pending, []
        reqs = [r for r in dict.fromkeys(pending) if self._should_send(r)]  # once each, in order
        if reqs:
            self.sink.send(_batch_token_id_out(reqs, self.speculative, self.storage_counts))
            for r in reqs:
                if r.finished():
                    self.unanswered.pop(r.rid, None)

    def _should_send(self, req: Req) -> bool:
        if req.finished() or self.stream_interval == 1 or not req.stream or req.send_token_offset == 0:
            return True
        # Tokens since the last message (a verify step may add several at once).
        return len(req.output_ids) - req.send_token_offset >= self.stream_interval


def _new_outputs(reqs: list[Req]) -> tuple[list[list[int]], list[list[int] | None], LogprobOutputs | None]:
    """Each request's output ids (and logprobs) new since its previous message, and its prompt
    tail while nothing was sent; advances their send offsets."""
    new_ids, tails = [], []
    logprobs = LogprobOutputs() if any(r.return_logprob for r in reqs) else None
    for r in reqs:
        start = r.send_token_offset
        new_ids.append(r.output_ids[start:])
        tails.append(r.origin_input_ids[-INIT_INCREMENTAL_DETOKENIZATION_OFFSET:] if start == 0 else None)
        if logprobs is not None:
            _add_logprob_outputs(logprobs, r, start)
        r.send_token_offset = len(r.output_ids)
    return new_ids, tails, logprobs


def _batch_token_id_out(reqs: list[Req], speculative: bool, storage_counts: bool) -> BatchTokenIDOut:
    """What is new since each request's previous message."""
    new_ids, tails, logprobs = _new_outputs(reqs)
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
        spec_verify_ct=[r.spec_verify_ct for r in reqs] if speculative else [],
        **(_tier_counts(reqs) if storage_counts else {}),
        **(logprobs.logprob_outputs() if logprobs is not None else {}),
    )


def _tier_counts(reqs: list[Req]) -> dict[str, list[int]]:
    """Of each request's cached tokens, those read from the storage tier and the host tier."""
    storage = [min(r.storage_hit_tokens, r.cached_tokens) for r in reqs]
    host = [min(r.host_hit_tokens, r.cached_tokens - s) for r, s in zip(reqs, storage)]
    return {"cached_tokens_storage": storage, "cached_tokens_host": host}


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
