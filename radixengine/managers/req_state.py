"""A request's state in the tokenizer manager while it runs (SGLang's ReqState): the outputs the
detokenizer sent so far, gathered message by message, and the output dicts built from them
(`text`, `output_ids`, `meta_info` with SGLang's logprob shapes)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from radixengine.managers.generate_output import GenerateOutput, LogprobTriple, MetaInfo
from radixengine.managers.io_struct import BatchStrOut, GenerateReqInput
from radixengine.sampling.sampling_params import SamplingParams

# Token ids -> their texts, one per id (for return_text_in_logprobs).
DecodeTokens = Callable[[list[int]], list[str]]


@dataclass
class LogprobState:
    """A request's logprobs in SGLang's meta_info shapes: `(logprob, token_id, text or None)` per
    token, and per position a list of those for the most likely tokens (None where there is no
    distribution: the first prompt token)."""

    input_token_logprobs: list[LogprobTriple] = field(default_factory=list)
    output_token_logprobs: list[LogprobTriple] = field(default_factory=list)
    input_top_logprobs: list[list[LogprobTriple] | None] = field(default_factory=list)
    output_top_logprobs: list[list[LogprobTriple] | None] = field(default_factory=list)

    def add_to(self, meta: MetaInfo, top_logprobs_num: int, copy: bool) -> None:
        """Its meta_info fields, into `meta`."""
        c = list if copy else (lambda x: x)
        meta.update(
            {
                "input_token_logprobs": c(self.input_token_logprobs),
                "output_token_logprobs": c(self.output_token_logprobs),
                "output_token_logprobs_length": len(self.output_token_logprobs),
            }
        )
        if top_logprobs_num > 0:
            meta["input_top_logprobs"] = c(self.input_top_logprobs)
            meta["output_top_logprobs"] = c(self.output_top_logprobs)

    def convert_logprob_style(
        self, recv: BatchStrOut, i: int, new_ids: list[int], decode: DecodeTokens | None
    ) -> None:
        """SGLang's convert_logprob_style: the i-th request's new logprobs of the message, as
        meta_info triples (with the tokens' texts when `decode` is given)."""
        if recv.input_token_logprobs_val[i] is not None:
            self.input_token_logprobs += _triples(
                recv.input_token_logprobs_val[i], recv.input_token_logprobs_idx[i], decode
            )
            if recv.input_top_logprobs_val[i] is not None:
                self.input_top_logprobs += _top_triples(
                    recv.input_top_logprobs_val[i], recv.input_top_logprobs_idx[i], decode
                )
        self.output_token_logprobs += _triples(recv.output_token_logprobs[i] or [], new_ids, decode)
        if recv.output_top_logprobs_val[i] is not None:
            self.output_top_logprobs += _top_triples(
                recv.output_top_logprobs_val[i], recv.output_top_logprobs_idx[i], decode
            )


def _triples(values: list, ids: list[int], decode: DecodeTokens | None) -> list[LogprobTriple]:
    if decode is None:
        return [(v, t, None) for v, t in zip(values, ids)]
    return list(zip(values, ids, decode(ids)))


def _top_triples(values: list, ids: list, decode: DecodeTokens | None) -> list[list[LogprobTriple] | None]:
    return [None if v is None else _triples(v, t, decode) for v, t in zip(values, ids)]


@dataclass
class ReqState:
    obj: GenerateReqInput
    sampling_params: SamplingParams
    prompt_tokens: int
    event: asyncio.Event = field(default_factory=asyncio.Event)
    outs: deque = field(default_factory=deque)
    finished: bool = False
    # Aborted by its caller: the state (and so the rid) is kept until the scheduler's final output
    # for it arrives, so that a new request with the same rid cannot receive the old one's outputs.
    aborted: bool = False
    # The outputs so far (the detokenizer sends what is new each step); the text only when streaming.
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: LogprobState | None = None  # with return_logprob
    created_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    last_token_time: float | None = None
    queue_time_seen: bool = False

    def add_output(self, recv: BatchStrOut, i: int, decode: DecodeTokens) -> int:
        """Append the i-th request's new ids, logprobs and (streaming) text of the message;
        returns how many ids are new."""
        new_ids = recv.output_ids[i]
        self.output_ids.extend(new_ids)
        if self.logprobs is not None and recv.output_token_logprobs:
            with_text = decode if self.obj.return_text_in_logprobs else None
            self.logprobs.convert_logprob_style(recv, i, new_ids, with_text)
        if recv.finished_reasons[i] is not None:
            self.text = recv.output_strs[i]  # the whole final text
        elif self.obj.stream:
            self.text += recv.output_strs[i]
        return len(new_ids)

    def make_output(self, recv: BatchStrOut, i: int, now: float) -> GenerateOutput:
        """The request's output so far (copies while it streams: later steps extend the state)."""
        reason = recv.finished_reasons[i]
        meta: MetaInfo = {
            "id": recv.rids[i],
            "prompt_tokens": recv.prompt_tokens[i],
            "completion_tokens": len(self.output_ids),
            "cached_tokens": recv.cached_tokens[i],
            "finish_reason": self._name_grammar_field(reason),
            "e2e_latency": now - self.created_time,
        }
        if recv.cached_tokens_storage:
            storage = recv.cached_tokens_storage[i]
            host = recv.cached_tokens_host[i] if recv.cached_tokens_host else 0
            meta["cached_tokens_details"] = {
                "device": meta["cached_tokens"] - storage - host,
                "host": host,
                "storage": storage,
            }
        finished = reason is not None
        if recv.spec_verify_ct:
            meta["spec_verify_ct"] = recv.spec_verify_ct[i]
        if self.logprobs is not None:
            self.logprobs.add_to(meta, self.obj.top_logprobs_num, copy=not finished)
        text = self.text if finished else self.visible_text()
        ids = self.output_ids if finished else list(self.output_ids)
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def _name_grammar_field(self, reason: dict | None) -> dict | None:
        """A scheduler error naming the grammar by its kind names the field it came from."""
        field, key = self.obj.grammar_field, self.sampling_params.grammar_key
        if field is None or reason is None or key is None or reason.get("param") != key[0]:
            return reason
        return {**reason, "param": field}

    def visible_text(self) -> str:
        """While streaming, hold back a tail that may turn out to be the start of a stop string."""
        params, text = self.sampling_params, self.text
        if not params.stop_strs or params.no_stop_trim:
            return text
        for stop in params.stop_strs:
            pos = text.find(stop)
            if pos != -1:
                text = text[:pos]
        hold = 0
        for stop in params.stop_strs:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        return text[: len(text) - hold]
