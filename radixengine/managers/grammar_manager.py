"""GrammarManager: the scheduler's side of constrained decoding (SGLang's). A request whose
grammar is still compiling waits in the grammar queue (the compile runs on the backend's thread
pool, so running batches go on); once its future is done it joins the waiting queue with its own
matcher, or fails with a 400 naming the compile error."""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, wait

from radixengine.constrained.backend_factory import create_grammar_backend
from radixengine.constrained.base_grammar_backend import InvalidGrammarObject
from radixengine.managers.req import Req, Tokenizer
from radixengine.server_args import ServerArgs

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.005  # how long an otherwise idle scheduler waits for a compile per step


class GrammarManager:
    """The backend is built on the first constrained request (its tokenizer info costs time and
    memory a server that never sees one need not pay); a tokenizer it cannot read fails those
    requests with the reason, never the scheduler."""

    @classmethod
    def from_server_args(
        cls, args: ServerArgs, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: frozenset[int]
    ) -> GrammarManager:
        """Under tensor parallelism a compile is waited for (every rank must see the same queue)."""
        any_whitespace = not args.constrained_json_disable_any_whitespace
        return cls(
            args.grammar_backend, any_whitespace, tokenizer, vocab_size, eos_token_ids, args.tp_size > 1
        )

    def __init__(
        self,
        backend_name: str,
        any_whitespace: bool,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        wait_for_compile: bool = False,
    ) -> None:
        self.backend_name = backend_name
        self.any_whitespace = any_whitespace
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.backend = None
        self.backend_error: str | None = None
        self.grammar_queue: list[Req] = []
        # Tensor parallel: every rank must admit the request at the same step, so wait for the compile.
        self.wait_for_compile = wait_for_compile

    def __len__(self) -> int:
        return len(self.grammar_queue)

    def process_req_with_grammar(self, req: Req) -> str | None:
        """Start the request's grammar: None when it is ready (`req.grammar` is its matcher) or
        queued here (`req.grammar` is the compile's Future); else why it cannot run."""
        kind, _ = key = req.sampling_params.grammar_key
        error = self._ensure_backend()
        if error is not None:
            return f"{kind}: {error}"
        future = self.backend.get_future(key)
        if future.done() or self.wait_for_compile:
            return self._resolve(req, future)
        req.grammar = future
        self.grammar_queue.append(req)
        return None

    def _ensure_backend(self) -> str | None:
        if self.backend is not None:
            return None
        if self.backend_name == "none":
            return (
                "constrained decoding (json_schema, regex, ebnf, structural_tag) is not supported "
                "when the server is launched with --grammar-backend none"
            )
        if self.tokenizer is None:
            return "constrained decoding needs the model's tokenizer"
        if self.backend_error is None:
            try:
                self.backend = create_grammar_backend(
                    self.backend_name,
                    self.tokenizer,
                    self.vocab_size,
                    self.eos_token_ids,
                    any_whitespace=self.any_whitespace,
                )
            except Exception as e:  # a tokenizer the backend cannot read
                logger.error("cannot build the %s grammar backend: %s", self.backend_name, e)
                self.backend_error = f"the {self.backend_name} grammar backend cannot use this tokenizer: {e}"
        return self.backend_error

    def get_ready_grammar_requests(self, block: bool = False) -> list[tuple[Req, str | None]]:
        """The queued requests whose compile is done, each with its error (None when it can run).
        With `block` (nothing else to do), first wait a little for one to finish."""
        if not self.grammar_queue:
            return []
        if block:
            wait(
                [r.grammar for r in self.grammar_queue], timeout=POLL_INTERVAL_S, return_when=FIRST_COMPLETED
            )
        # done() is read once a request: a compile that finishes between two reads must land in one list.
        ready, waiting = [], []
        for r in self.grammar_queue:
            (ready if r.grammar.done() else waiting).append(r)
        self.grammar_queue = waiting
        return [(r, self._resolve(r, r.grammar)) for r in ready]

    def abort_request(self, rid: str) -> Req | None:
        for i, req in enumerate(self.grammar_queue):
            if req.rid == rid:
                del self.grammar_queue[i]
                req.grammar = None  # the compile goes on: its result is cached for the next request
                return req
        return None

    def reset(self) -> None:
        if self.backend is not None:
            self.backend.reset()

    @staticmethod
    def _resolve(req: Req, future: Future) -> str | None:
        value = future.result()
        if isinstance(value, InvalidGrammarObject):
            req.grammar = None
            return value.error_message
        req.grammar = value.copy()
        return None
