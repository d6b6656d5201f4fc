"""DetokenizerManager: turns the scheduler's token ids into text, incrementally, in its own process.

The scheduler sends each request's output ids once (only the new ones each step); the detokenizer
keeps them per request until the request's finish reason comes, then drops its state.
Incremental decoding as in SGLang: per request, `surr_offset..read_offset` is the window of ids
already turned into text, kept as context so that the next piece decodes the way it would in the
full sequence (leading spaces, merges). The window starts in the last prompt tokens (the first
message of a request carries them), so the first output token keeps its leading space with
SentencePiece tokenizers. A piece whose text ends in U+FFFD is an incomplete UTF-8 character split
across tokens: it is held back until the next token completes it. When a request finishes, its
whole output is decoded once after the same prompt tokens (the final text never depends on how it
was streamed) and trimmed at the matched stop string or stop token unless `no_stop_trim`."""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

from radixengine.managers.io_struct import BatchStrOut, BatchTokenIDOut

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"


@dataclass
class DecodeStatus:
    """One request: `ids` is the prompt's tail (`prefix_len` ids, decode context only) followed by
    every output id so far."""

    ids: list[int]
    prefix_len: int
    prefix_text: str  # the decoded prompt tail
    decoded_text: str = ""  # text of the output ids before read_offset, never ending in a broken char
    surr_offset: int = 0
    read_offset: int = 0
    sent_len: int = 0  # how much of decoded_text the previous messages carried
    spaces_between_special_tokens: bool = True


def trim_matched_stop(text: str, output_ids: list[int], finished_reason: dict | None, no_stop_trim: bool):
    """Cut the output at the stop string or stop token that finished it (SGLang's rule)."""
    if no_stop_trim or not finished_reason or finished_reason.get("type") != "stop":
        return text, output_ids
    matched = finished_reason.get("matched")
    if isinstance(matched, str):
        pos = text.find(matched)
        return (text[:pos] if pos != -1 else text), output_ids
    if isinstance(matched, int) and output_ids and output_ids[-1] == matched:
        return text, output_ids[:-1]
    return text, output_ids


class IncrementalDetokenizer:
    """Per-request decode state over a HF tokenizer (no I/O: the process loop wraps it)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.status: dict[str, DecodeStatus] = {}

    def decode(
        self, ids: list[int], skip_special_tokens: bool, spaces_between_special_tokens: bool = True
    ) -> str:
        # transformers' default is True; only its slow (Python) tokenizers read it
        extra = {} if spaces_between_special_tokens else {"spaces_between_special_tokens": False}
        return self.tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False, **extra
        )

    def step(
        self,
        rid: str,
        new_ids: list[int],
        skip_special_tokens: bool,
        finished_reason: dict | None = None,
        no_stop_trim: bool = False,
        prompt_tail_ids: list[int] | None = None,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        """Take the request's new output ids; return its text so far (everything decodable), or
        its trimmed final text once finished (and forget the request). The first call for a
        request must give `prompt_tail_ids` (an empty list for no context)."""
        status = self.status.get(rid)
        if status is None:
            status = self.status[rid] = self.new_status(rid, prompt_tail_ids, skip_special_tokens)
            status.spaces_between_special_tokens = spaces_between_special_tokens
        status.ids.extend(new_ids)
        if finished_reason is not None:
            del self.status[rid]
            return self.finish_text(status, skip_special_tokens, finished_reason, no_stop_trim)
        if len(status.ids) == status.read_offset:
            return status.decoded_text
        spaces = status.spaces_between_special_tokens
        surr_text = self.decode(
            status.ids[status.surr_offset : status.read_offset], skip_special_tokens, spaces
        )
        new_text = self.decode(status.ids[status.surr_offset :], skip_special_tokens, spaces)
        if new_text.endswith(REPLACEMENT_CHAR):
            return status.decoded_text  # incomplete character: wait for the next token
        status.decoded_text += new_text[len(surr_text) :]
        status.surr_offset = status.read_offset
        status.read_offset = len(status.ids)
        return status.decoded_text

    def new_status(
        self, rid: str, prompt_tail_ids: list[int] | None, skip_special_tokens: bool
    ) -> DecodeStatus:
        if prompt_tail_ids is None:
            raise ValueError(f"request {rid!r}: its first output came without the prompt's tail ids")
        tail = list(prompt_tail_ids)
        text = self.decode(tail, skip_special_tokens)
        while tail and text.endswith(REPLACEMENT_CHAR):
            # A prompt ending inside a character: its last bytes are no context for the output.
            tail.pop()
            text = self.decode(tail, skip_special_tokens)
        return DecodeStatus(ids=tail, prefix_len=len(tail), prefix_text=text, read_offset=len(tail))

    def finish_text(
        self, status: DecodeStatus, skip_special_tokens: bool, finished_reason: dict, no_stop_trim: bool
    ) -> str:
        _, ids = trim_matched_stop("", status.ids[status.prefix_len :], finished_reason, no_stop_trim)
        text = self.decode(
            status.ids[: status.prefix_len] + ids, skip_special_tokens, status.spaces_between_special_tokens
        )
        text = text[len(status.prefix_text) :]
        text, _ = trim_matched_stop(text, ids, finished_reason, no_stop_trim)
        return text

    def handle_batch_token_id_out(self, recv: BatchTokenIDOut) -> BatchStrOut:
        texts = [self._new_text(recv, i) for i in range(len(recv.rids))]
        return BatchStrOut(
            rids=recv.rids,
            finished_reasons=recv.finished_reasons,
            output_strs=texts,
            output_ids=recv.output_ids,
            prompt_tokens=recv.prompt_tokens,
            cached_tokens=recv.cached_tokens,
            queue_times=recv.queue_times,
            spec_verify_ct=recv.spec_verify_ct,
            cached_tokens_storage=recv.cached_tokens_storage,
            cached_tokens_host=recv.cached_tokens_host,
            **recv.logprob_outputs(),
        )

    def _new_text(self, recv: BatchTokenIDOut, i: int) -> str:
        """The text the i-th request's message carries: new since its last one, or the final text."""
        rid, reason = recv.rids[i], recv.finished_reasons[i]
        skip, no_stop_trim, tail = recv.skip_special_tokens[i], recv.no_stop_trim[i], recv.prompt_tail_ids[i]
        spaces = recv.spaces_between_special_tokens[i] if recv.spaces_between_special_tokens else True
        text = self.step(rid, recv.output_ids[i], skip, reason, no_stop_trim, tail, spaces)
        if reason is not None:
            return text
        status = self.status[rid]
        new, status.sent_len = text[status.sent_len :], len(text)
        return new


class FastDecoder:
    """Decoding straight from `tokenizer.json` with the `tokenizers` library: what a transformers
    fast tokenizer does to decode, without importing transformers (seconds of start-up)."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(path)

    def decode(
        self,
        ids: list[int],
        skip_special_tokens: bool = True,
        clean_up_tokenization_spaces: bool = False,
        spaces_between_special_tokens: bool = True,  # a fast tokenizer has no such option
    ):
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def load_decoder(server_args):
    """`server_args.tokenizer_path` is the resolved tokenizer folder (the engine sets it)."""
    path = os.path.join(server_args.tokenizer_path or "", "tokenizer.json")
    if server_args.tokenizer_path and os.path.exists(path):
        return FastDecoder(path)
    from radixengine.managers.served_model import load_tokenizer

    return load_tokenizer(server_args)


class DetokenizerManager:
    """The detokenizer process: BatchTokenIDOut in (from the scheduler), BatchStrOut out."""

    def __init__(self, server_args, port_args) -> None:
        import zmq

        self.detokenizer = IncrementalDetokenizer(load_decoder(server_args))
        self.context = zmq.Context(2)
        self.recv_from_scheduler = self.context.socket(zmq.PULL)
        self.recv_from_scheduler.bind(port_args.detokenizer_ipc_name)
        self.send_to_tokenizer = self.context.socket(zmq.PUSH)
        self.send_to_tokenizer.connect(port_args.tokenizer_ipc_name)

    def event_loop(self) -> None:
        while True:
            recv = self.recv_from_scheduler.recv_pyobj()
            if isinstance(recv, BatchTokenIDOut):
                self.send_to_tokenizer.send_pyobj(self.detokenizer.handle_batch_token_id_out(recv))
            else:  # anything else is for the tokenizer manager: pass it on
                self.send_to_tokenizer.send_pyobj(recv)


def run_detokenizer_process(server_args, port_args, pipe_writer) -> None:
    from radixengine.utils.process import watch_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent shuts us down
    watch_parent(os.getppid())
    logging.basicConfig(level=server_args.log_level.upper(), format="[detokenizer] %(message)s")
    try:
        manager = DetokenizerManager(server_args, port_args)
    except Exception as e:  # report, then exit: the parent raises with this message
        logger.exception("detokenizer failed to start")
        pipe_writer.send({"status": "error", "error": f"{type(e).__name__}: {e}"})
        return
    pipe_writer.send({"status": "ready"})
    manager.event_loop()
