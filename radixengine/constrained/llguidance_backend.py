"""Constrained decoding with llguidance (`--grammar-backend llguidance`)."""

from __future__ import annotations

import json
import logging

import torch
from llguidance import LLMatcher, LLTokenizer, grammar_from
from llguidance.hf import from_tokenizer
from llguidance.torch import fill_next_token_bitmask

from radixengine.constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject

logger = logging.getLogger(__name__)

ANY_JSON = "$$ANY$$"


class GuidanceGrammar(BaseGrammarObject):
    def __init__(self, tokenizer: LLTokenizer, serialized_grammar: str) -> None:
        self.tokenizer = tokenizer
        self.serialized_grammar = serialized_grammar
        self.matcher = LLMatcher(tokenizer, serialized_grammar)
        self.eos_tokens = set(tokenizer.eos_tokens)
        self.finished = False
        self._check_err()

    def accept_token(self, token: int) -> None:
        if self.finished:
            return
        if self.matcher.is_stopped() and token in self.eos_tokens:
            self.finished = True  # llguidance stops before EOS; EOS ends it
            return
        if not self.matcher.consume_token(token):
            raise ValueError(f"token {token} is not allowed by the grammar: {self.matcher.get_error()}")
        self.finished = token in self.eos_tokens and self.matcher.is_stopped()

    def is_terminated(self) -> bool:
        return self.finished

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        fill_next_token_bitmask(self.matcher, vocab_mask, idx)
        if self.matcher.is_error():
            # A dead end (nothing can follow): llguidance allows only EOS there, which would end
            # the request with an output that does not match. No token at all, as xgrammar does.
            logger.info("llguidance: no token can continue: %s", self.matcher.get_error().partition("\n")[0])
            vocab_mask[idx].zero_()

    def copy(self) -> GuidanceGrammar:
        return GuidanceGrammar(self.tokenizer, self.serialized_grammar)

    def _check_err(self) -> None:
        if self.matcher.is_error():
            raise ValueError(self.matcher.get_error())


class GuidanceBackend(BaseGrammarBackend):
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], any_whitespace: bool) -> None:
        super().__init__(vocab_size)
        self.tokenizer = from_tokenizer(tokenizer, vocab_size, eos_token=sorted(eos_token_ids) or None)
        self.any_whitespace = any_whitespace

    def _grammar(self, serialized: str) -> GuidanceGrammar:
        return GuidanceGrammar(self.tokenizer, serialized)

    def dispatch_json_schema(self, text: str) -> GuidanceGrammar:
        return self._grammar(json_grammar(text, self.any_whitespace))

    def dispatch_regex(self, text: str) -> GuidanceGrammar:
        return self._grammar(grammar_from("regex", text))

    def dispatch_ebnf(self, text: str) -> GuidanceGrammar:
        return self._grammar(grammar_from("ebnf", text))

    def dispatch_structural_tag(self, text: str) -> GuidanceGrammar:
        raise ValueError("structural_tag needs --grammar-backend xgrammar")


def json_grammar(text: str, any_whitespace: bool = True) -> str:
    schema = {} if text == ANY_JSON else text
    if isinstance(schema, dict):
        schema = json.dumps(schema)
    return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": any_whitespace})


def validate(kind: str, text: str) -> None:
    """Check the grammar without a tokenizer (for the front end); raises on a bad one."""
    if kind == "structural_tag":
        raise ValueError("structural_tag needs --grammar-backend xgrammar")
    grammar = json_grammar(text) if kind == "json_schema" else grammar_from(kind, text)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError("; ".join(messages) if isinstance(messages, list) else str(messages))
