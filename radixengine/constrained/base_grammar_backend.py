"""The grammar objects a constrained request carries, and the backend that compiles them.

A grammar is compiled once per (kind, text) key on a thread pool, so a long compile never stalls
the scheduler: the request waits in the scheduler's grammar queue until its future is done. Each
request gets its own matcher (`copy()` of the compiled grammar), advanced by `accept_token` with
every sampled token, asked for the allowed tokens by `fill_vocab_mask`.

The vocabulary mask is SGLang's (and xgrammar's) packed layout: int32 [rows, ceil(vocab / 32)],
bit j of word w allows token 32 w + j. llguidance fills the same layout.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "none")
MAX_CACHED_GRAMMARS = 1024
GrammarKey = tuple[str, str]  # (json_schema | regex | ebnf | structural_tag, text)


class BaseGrammarObject:
    """One request's matcher."""

    def accept_token(self, token: int) -> None:
        """Advance by `token`; a ValueError when the grammar does not allow it."""
        raise NotImplementedError

    def is_terminated(self) -> bool:
        raise NotImplementedError

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        raise NotImplementedError

    def copy(self) -> BaseGrammarObject:
        """A fresh matcher of the same compiled grammar (at its start)."""
        raise NotImplementedError

    def allows_no_token(self, vocab_size: int) -> bool:
        """Stuck: not ended, and no token (EOS included) may come next, so no output that goes
        through this state matches the grammar. One mask fill: asked once per compiled grammar
        and when a row had nothing to sample, never per step."""
        if self.is_terminated():
            return False
        mask = allocate_vocab_mask(1, vocab_size)
        self.fill_vocab_mask(mask, 0)
        return not _any_token(mask[0], vocab_size)

    @classmethod
    def batch_fill_vocab_mask(
        cls, grammars: list[BaseGrammarObject], vocab_mask: torch.Tensor, rows: list[int]
    ) -> None:
        """Fill `rows` of the mask from `grammars` (all of this class)."""
        for grammar, row in zip(grammars, rows):
            grammar.fill_vocab_mask(vocab_mask, row)


@dataclass
class InvalidGrammarObject:
    """A grammar that failed to compile: the request gets a 400 with this message."""

    error_message: str


class BaseGrammarBackend:
    def __init__(self, vocab_size: int, num_threads: int = 2) -> None:
        self.vocab_size = vocab_size
        self.executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="grammar-compile")
        self.cache: OrderedDict[GrammarKey, Future] = OrderedDict()

    def get_future(self, key: GrammarKey) -> Future:
        """The compile of `key` (cached by key, failures included): a Future of a grammar object
        (at its start; callers `copy()` it) or an InvalidGrammarObject."""
        future = self.cache.get(key)
        if future is not None:
            self.cache.move_to_end(key)
            return future
        future = self.executor.submit(self._compile, key)
        self.cache[key] = future
        if len(self.cache) > MAX_CACHED_GRAMMARS:
            self.cache.popitem(last=False)
        return future

    def _compile(self, key: GrammarKey) -> BaseGrammarObject | InvalidGrammarObject:
        kind, text = key
        try:
            grammar = getattr(self, f"dispatch_{kind}")(text)
            stuck = grammar.copy().allows_no_token(self.vocab_size)
        except Exception as e:  # a compile error is the request's, never the scheduler's
            logger.info("invalid %s grammar: %s", kind, e)
            return InvalidGrammarObject(f"Failed to compile the {kind} grammar: {e}")
        if stuck:
            return InvalidGrammarObject(no_output_message(kind))
        return grammar

    def dispatch_json_schema(self, text: str) -> BaseGrammarObject:
        raise NotImplementedError

    def dispatch_regex(self, text: str) -> BaseGrammarObject:
        raise NotImplementedError

    def dispatch_ebnf(self, text: str) -> BaseGrammarObject:
        raise NotImplementedError

    def dispatch_structural_tag(self, text: str) -> BaseGrammarObject:
        raise NotImplementedError

    def reset(self) -> None:
        self.cache.clear()

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def allocate_vocab_mask(batch_size: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """All tokens allowed: int32 [batch_size, ceil(vocab_size / 32)] of -1 (every bit set)."""
    words = (vocab_size + 31) // 32
    return torch.full((batch_size, words), -1, dtype=torch.int32, pin_memory=pin_memory)


def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor, rows: list[int]) -> None:
    """In place: the disallowed tokens of `rows` at -inf; the other rows are not touched."""
    import xgrammar

    if vocab_mask.device != logits.device:
        vocab_mask = vocab_mask.to(logits.device, non_blocking=True)
    xgrammar.apply_token_bitmask_inplace(logits, vocab_mask, vocab_size=logits.shape[-1], indices=rows)


def no_output_message(kind: str, num_generated: int = 0) -> str:
    """Why a request whose grammar allows no next token fails (`num_generated` output tokens in)."""
    if num_generated == 0:
        return f"the {kind} matches no output: it allows no first token"
    return (
        f"the {kind} matches no output that begins with the {num_generated} token(s) generated: "
        f"it allows no next token"
    )


def _any_token(row: torch.Tensor, vocab_size: int) -> bool:
    """Whether a packed mask row allows any of the first `vocab_size` tokens."""
    full, rest = divmod(vocab_size, 32)
    if bool(row[:full].any()):
        return True
    return rest > 0 and bool(int(row[full]) & ((1 << rest) - 1))
