"""Constrained decoding with xgrammar (the default backend)."""

from __future__ import annotations

import functools
import json
import os

import torch
import xgrammar as xgr

from radixengine.constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject

ANY_JSON = "$$ANY$$"  # SGLang's json_schema for any JSON value


@functools.cache
def _batch_matcher() -> xgr.BatchGrammarMatcher:
    return xgr.BatchGrammarMatcher(max_threads=max(1, min(8, (os.cpu_count() or 2) // 2)))


class XGrammarGrammar(BaseGrammarObject):
    def __init__(self, ctx: xgr.CompiledGrammar) -> None:
        self.ctx = ctx
        self.matcher = xgr.GrammarMatcher(ctx)

    def accept_token(self, token: int) -> None:
        if not self.matcher.is_terminated() and not self.matcher.accept_token(token):
            raise ValueError(f"token {token} is not allowed by the grammar")

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        self.matcher.fill_next_token_bitmask(vocab_mask, idx)

    def copy(self) -> XGrammarGrammar:
        return XGrammarGrammar(self.ctx)

    @classmethod
    def batch_fill_vocab_mask(
        cls, grammars: list[XGrammarGrammar], vocab_mask: torch.Tensor, rows: list[int]
    ) -> None:
        """One call for the batch: xgrammar fills the rows with the GIL released, so an overlapped
        forward on another thread is not held up."""
        _batch_matcher().batch_fill_next_token_bitmask([g.matcher for g in grammars], vocab_mask, rows)


class XGrammarGrammarBackend(BaseGrammarBackend):
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], any_whitespace: bool) -> None:
        super().__init__(vocab_size)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids) or None
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.any_whitespace = any_whitespace

    def dispatch_json_schema(self, text: str) -> XGrammarGrammar:
        if text == ANY_JSON:
            return XGrammarGrammar(self.compiler.compile_builtin_json_grammar())
        return XGrammarGrammar(self.compiler.compile_json_schema(text, any_whitespace=self.any_whitespace))

    def dispatch_regex(self, text: str) -> XGrammarGrammar:
        return XGrammarGrammar(self.compiler.compile_regex(text))

    def dispatch_ebnf(self, text: str) -> XGrammarGrammar:
        return XGrammarGrammar(self.compiler.compile_grammar(text))

    def dispatch_structural_tag(self, text: str) -> XGrammarGrammar:
        return XGrammarGrammar(self.compiler.compile_structural_tag(_structural_tag(text)))

    def reset(self) -> None:
        super().reset()
        self.compiler.clear_cache()


def _structural_tag(text: str) -> str | xgr.StructuralTag:
    """SGLang's legacy form ({"structures": [{begin, schema, end}], "triggers": [...]}) as an
    xgrammar StructuralTag; the current form ({"type": "structural_tag", "format": ...}) as is."""
    tag = json.loads(text)
    if isinstance(tag, dict) and "structures" in tag and "triggers" in tag:
        items = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema") or {}), end=s["end"])
            for s in tag["structures"]
        ]
        return xgr.StructuralTag.from_legacy_structural_tag(items, tag["triggers"])
    return text


def validate(kind: str, text: str) -> None:
    """Parse the grammar without a tokenizer (fast, for the front end); raises on a bad one."""
    if kind == "json_schema":
        if text != ANY_JSON:
            xgr.Grammar.from_json_schema(text)
    elif kind == "regex":
        xgr.Grammar.from_regex(text)
    elif kind == "ebnf":
        xgr.Grammar.from_ebnf(text)
    else:
        xgr.Grammar.from_structural_tag(_structural_tag(text))
