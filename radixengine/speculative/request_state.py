"""One request's NGRAM drafting state, kept on the request across steps and retractions."""

from __future__ import annotations

from dataclasses import dataclass

from radixengine.speculative.ngram_index import NgramIndex

INITIAL_TOKENS_PER_VERIFY = 1.6  # a new request: two misses in a row pause it
BACKOFF_STEPS = 8


@dataclass
class RequestSpecState:
    """One request's drafting state: its n-gram index and how its drafts have fared."""

    index: NgramIndex
    tokens_per_verify: float = INITIAL_TOKENS_PER_VERIFY
    skip_steps: int = 0  # decode steps left without drafting
    backoff: int = BACKOFF_STEPS
