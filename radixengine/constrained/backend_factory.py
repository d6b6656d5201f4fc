"""The grammar backend `--grammar-backend` names, and the front end's grammar check.

The backends import `base_grammar_backend`; this module imports them (on first use, so an optional
backend that is not installed costs nothing until it is named), and nothing imports it back.
"""

from __future__ import annotations

import json

from radixengine.constrained.base_grammar_backend import GRAMMAR_BACKENDS, BaseGrammarBackend


def create_grammar_backend(
    name: str,
    tokenizer,
    vocab_size: int,
    eos_token_ids: list[int],
    any_whitespace: bool = True,
) -> BaseGrammarBackend | None:
    """The backend `--grammar-backend` names (None for `none`), its tokenizer info built once from
    the HF tokenizer; tokens past the tokenizer's vocabulary (the model's padding) are never allowed."""
    if name == "none":
        return None
    if name == "xgrammar":
        from radixengine.constrained.xgrammar_backend import XGrammarGrammarBackend

        return XGrammarGrammarBackend(tokenizer, vocab_size, eos_token_ids, any_whitespace)
    if name == "llguidance":
        from radixengine.constrained.llguidance_backend import GuidanceBackend

        return GuidanceBackend(tokenizer, vocab_size, eos_token_ids, any_whitespace)
    raise ValueError(f"unknown grammar backend {name!r}; choose from {', '.join(GRAMMAR_BACKENDS)}")


def validate_grammar(backend: str, kind: str, text: str) -> str | None:
    """Why the grammar cannot be used (a message naming the problem), or None. Parses it without
    the tokenizer, so the front end can refuse a bad grammar before it reaches the scheduler."""
    if backend == "none":
        return (
            f"{kind}: constrained decoding (json_schema, regex, ebnf, structural_tag) is not supported "
            f"when the server is launched with --grammar-backend none"
        )
    if kind in ("json_schema", "structural_tag") and text != "$$ANY$$":
        try:
            json.loads(text)
        except ValueError as e:
            return f"{kind} is not valid JSON: {e}"
    if backend == "xgrammar":
        from radixengine.constrained.xgrammar_backend import validate
    else:
        from radixengine.constrained.llguidance_backend import validate
    try:
        validate(kind, text)
    except Exception as e:
        return f"invalid {kind}: {_first_line(str(e))}"
    return None


def _first_line(message: str) -> str:
    """The message's first line, without xgrammar's "[hh:mm:ss] /path/file.cc:83: " prefix."""
    line = (message.strip().splitlines() or [""])[0]
    if line.startswith("[") and "] " in line:
        line = line.split("] ", 1)[1]
        head, sep, rest = line.partition(": ")
        if sep and ".cc:" in head:
            line = rest
    return line
