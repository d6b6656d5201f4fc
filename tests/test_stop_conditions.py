"""Stop conditions as SGLang has them: min_new_tokens keeps EOS and stop tokens from being sampled
(not just from finishing), ignore_eos turns off every token-based stop, the tokenizer's EOS id
counts, and stop strings whose characters span several tokens are found."""

from __future__ import annotations

import pytest
from sched_utils import (
    EOS,
    gen_req,
    make_scheduler,
    oracle_greedy,
    oracle_greedy_min_new_tokens,
    random_prompts,
    run_to_completion,
)


def prompt_reaching_its_stop(seed: int) -> tuple[list[int], list[int]]:
    """A prompt whose greedy continuation (no EOS) repeats a token early: that token, used as a
    stop token, would end the request before the minimum."""
    for s in range(seed, seed + 50):
        prompt = random_prompts(s, 1, 10, 10)[0]
        full = oracle_greedy(prompt, 24, ignore_eos=True)
        if EOS not in full[:12]:
            return prompt, full
    raise AssertionError("no prompt found")


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_min_new_tokens_keeps_stop_tokens_and_eos_from_being_sampled(overlap):
    prompt, full = prompt_reaching_its_stop(900)
    stop = full[1]
    eos = full[3]
    sched = make_scheduler(overlap=overlap, eos_token_ids=frozenset({eos}))
    reqs = [
        gen_req("stop", prompt, 24, stop_token_ids=[stop], min_new_tokens=8),
        gen_req("eos", prompt, 24, min_new_tokens=6),
        gen_req("plain", prompt, 24, stop_token_ids=[stop]),
    ]
    results = run_to_completion(sched, reqs)
    expected = oracle_greedy_min_new_tokens(prompt, 24, 8, [stop, eos])
    assert results["stop"].output_ids == expected
    assert stop not in expected[:8] and eos not in expected[:8]
    assert results["eos"].output_ids == oracle_greedy_min_new_tokens(prompt, 24, 6, [eos])
    assert results["plain"].output_ids == full[:2]  # no minimum: stops at once


def test_ignore_eos_ignores_stop_token_ids_too():
    prompt, full = prompt_reaching_its_stop(920)
    sched = make_scheduler()
    results = run_to_completion(sched, [gen_req("i", prompt, 24, stop_token_ids=[full[1]], ignore_eos=True)])
    assert results["i"].output_ids == full
    assert results["i"].finished_reason == {"type": "length", "length": 24}


class LetterTokenizer:
    """Token t decodes to one letter; `eos_token_id` as a real tokenizer has it."""

    def __init__(self, eos_token_id: int | None = None) -> None:
        self.eos_token_id = eos_token_id

    @staticmethod
    def decode(ids: list[int]) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)


def test_the_tokenizers_eos_token_id_stops_a_request():
    prompt, full = prompt_reaching_its_stop(940)
    eos = full[4]
    sched = make_scheduler(tokenizer=LetterTokenizer(eos_token_id=eos))
    assert eos in sched.eos_token_ids
    results = run_to_completion(sched, [gen_req("t", prompt, 24)])
    assert results["t"].output_ids == full[: full.index(eos) + 1]
    assert results["t"].finished_reason == {"type": "stop", "matched": eos}


class MultiTokenCharTokenizer:
    """One character ("€") spans three tokens, like a 3-byte UTF-8 character under a byte-level
    BPE: `lead` followed by two of `conts`. A partial sequence decodes to nothing; any other token
    decodes to one letter."""

    CHAR = "€"

    def __init__(self, lead: int, conts: set[int]) -> None:
        self.lead, self.conts = lead, conts
        self.eos_token_id = None

    def decode(self, ids: list[int]) -> str:
        out, i = [], 0
        while i < len(ids):
            if ids[i] == self.lead and all(t in self.conts for t in ids[i + 1 : i + 3]) and i + 2 < len(ids):
                out.append(self.CHAR)
                i += 3
                continue
            special = ids[i] == self.lead or ids[i] in self.conts
            out.append("" if special else chr(ord("a") + ids[i] % 26))
            i += 1
        return "".join(out)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        for ch in text:
            ids += [self.lead, *sorted(self.conts)[:2]] if ch == self.CHAR else [ord(ch) - ord("a")]
        return ids


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_stop_string_spanning_more_tokens_than_characters_is_found(overlap):
    prompt, full = prompt_reaching_its_stop(960)
    start = next(i for i in range(4, 20) if full[i] not in full[i + 1 : i + 3] and full[i + 1] != full[i + 2])
    tokenizer = MultiTokenCharTokenizer(full[start], {full[start + 1], full[start + 2]})
    end = next(k for k in range(1, 25) if tokenizer.CHAR in tokenizer.decode(full[:k]))
    assert end <= start + 3
    sched = make_scheduler(tokenizer=tokenizer, overlap=overlap)
    results = run_to_completion(sched, [gen_req("s", prompt, 24, stop=tokenizer.CHAR, ignore_eos=True)])
    assert results["s"].output_ids == full[:end]
    assert results["s"].finished_reason == {"type": "stop", "matched": tokenizer.CHAR}
