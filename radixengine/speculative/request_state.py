"""One request's NGRAM drafting state, kept on the request across steps and retractions; and
under the overlap loop, the verify step launched for it last."""

from __future__ import annotations

from dataclasses import dataclass

from radixengine.speculative.ngram_index import NgramIndex
from radixengine.speculative.spec_pacing import SpecPacing


@dataclass
class RequestSpecState:
    """One request's drafting state: its n-gram index and how its drafts have fared."""

    index: NgramIndex
    pacing: SpecPacing


@dataclass
class InflightStep:
    """The verify step launched last for a request under the overlap loop, as the host built it
    (speculative/spec_overlap.py): its drafts held if the step before it emitted `expected`
    (None: nothing was in flight), i.e. if the request's output from `base_len` on is `expected`."""

    drafts: list[int]
    expected: list[int] | None
    base_len: int  # the request's output tokens when the step was built

    def drafts_held(self, output_ids: list[int]) -> bool:
        return self.expected is None or output_ids[self.base_len :] == self.expected
