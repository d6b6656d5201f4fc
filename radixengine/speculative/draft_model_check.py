"""Whether a STANDALONE draft model can draft for the target, checked at start: its token ids must
be the target's (the same vocabulary size and, where both folders hold a tokenizer, the same token
for every id), else its first draft past the target's vocabulary (or the target's first token past
the draft's) would fail inside a forward, and drafts of other tokens would never be accepted."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
FLAG = "--speculative-draft-model-path"


class VocabConfig(Protocol):
    vocab_size: int


class Tokenizer(Protocol):
    def get_vocab(self) -> dict[str, int]: ...


def check_draft_model(
    draft: VocabConfig, target: VocabConfig, draft_dir: str, target_tokenizer_dir: str
) -> None:
    """Raise ValueError, naming what differs, when the draft model does not share the target's
    token ids."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"{FLAG}: the draft model's vocabulary has {draft.vocab_size} tokens, the target's "
            f"{target.vocab_size}; a draft model must share the target's vocabulary"
        )
    if has_tokenizer(draft_dir) and has_tokenizer(target_tokenizer_dir):
        compare_tokenizers(load_tokenizer(draft_dir), load_tokenizer(target_tokenizer_dir))


def has_tokenizer(folder: str) -> bool:
    return any(Path(folder, name).exists() for name in TOKENIZER_FILES)


def load_tokenizer(folder: str) -> Tokenizer:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def compare_tokenizers(draft: Tokenizer, target: Tokenizer) -> None:
    """The same token for every id (added tokens included), else ValueError; special ids that
    differ (a base draft for an instruct target) only stop the target, so they are logged."""
    draft_vocab, target_vocab = draft.get_vocab(), target.get_vocab()
    if draft_vocab != target_vocab:
        token = min(
            t for t in draft_vocab.keys() | target_vocab.keys() if draft_vocab.get(t) != target_vocab.get(t)
        )
        raise ValueError(
            f"{FLAG}: the draft model's tokenizer differs from the target's (token {token!r}: id "
            f"{draft_vocab.get(token)} in the draft's, {target_vocab.get(token)} in the target's); a draft "
            "model must share the target's tokenizer"
        )
    for name in SPECIAL_TOKENS:
        d, t = getattr(draft, name, None), getattr(target, name, None)
        if d != t:
            logger.warning("the draft model's tokenizer has %s %s, the target's %s", name, d, t)
