"""Incremental detokenization: UTF-8 safe, equal to a full decode, special tokens, stop trimming,
ids sent once each, and decoding after the prompt's tail (SentencePiece leading spaces)."""

from __future__ import annotations

import random

import pytest
from spm_utils import build_spm_tokenizer
from test_engine_utils import build_tokenizer

from radixengine.managers.detokenizer_manager import FastDecoder, IncrementalDetokenizer, trim_matched_stop
from radixengine.managers.io_struct import (
    INIT_INCREMENTAL_DETOKENIZATION_OFFSET,
    BatchTokenIDOut,
    finish_length,
    finish_matched_str,
)

TEXTS = [
    "héllo wörld, 世界 你好",
    "emoji 😀🎉 and rare ÿ ĳ ǅ ₿ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 chars",
    "The quick brown fox jumps over the lazy dog.",
    "  spaces\n\nnew lines\tand tabs  ",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tok")


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    return build_tokenizer(str(tok_dir))


def full_decode(tok, ids, skip=True):
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def stream(detok: IncrementalDetokenizer, ids: list[int], skip=True, rid="r", tail=()) -> list[str]:
    """The text so far after each id, the ids given one at a time (the first with the prompt's tail)."""
    return [
        detok.step(rid, [t], skip, prompt_tail_ids=list(tail) if i == 0 else None) for i, t in enumerate(ids)
    ]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode_and_never_breaks_a_char(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    texts = stream(detok, ids)
    for i, t in enumerate(texts):
        assert "\ufffd" not in t, f"broken character emitted after token {i}: {t!r}"
        assert text.startswith(t)
        if i:
            assert t.startswith(texts[i - 1])
    assert texts[-1] == text
    final = detok.step("r", [], True, finish_length(len(ids)))
    assert final == text and "r" not in detok.status


def test_multibyte_character_split_across_tokens_is_held_back(tokenizer):
    ids = tokenizer.encode("a😀")
    assert len(ids) >= 3, "the emoji must be split into byte tokens for this test"
    detok = IncrementalDetokenizer(tokenizer)
    texts = stream(detok, ids)
    assert texts[:-1] == ["a"] * (len(ids) - 1)
    assert texts[-1] == "a😀"


def test_random_ids_stream_is_prefix_of_final(tokenizer):
    rng = random.Random(0)
    detok = IncrementalDetokenizer(tokenizer)
    for n in range(20):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        rid = f"r{n}"
        seen = stream(detok, ids, rid=rid)
        final = detok.step(rid, [], True, finish_length(len(ids)))
        assert final == full_decode(tokenizer, ids)
        for t in seen:
            assert final.startswith(t)
            assert not t.endswith("\ufffd")
    assert detok.status == {}


def test_skip_special_tokens(tokenizer):
    ids = (
        tokenizer.encode("hello")
        + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        + tokenizer.encode(" world")
    )
    detok = IncrementalDetokenizer(tokenizer)
    assert stream(detok, ids, skip=True)[-1] == "hello world"
    detok = IncrementalDetokenizer(tokenizer)
    assert stream(detok, ids, skip=False)[-1] == "hello<|im_end|> world"


def test_stop_trimming(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("hello world. the end")
    detok = IncrementalDetokenizer(tokenizer)
    reason = finish_matched_str("world")
    assert detok.step("a", ids, True, reason, prompt_tail_ids=[]) == "hello "
    assert detok.step("b", ids, True, reason, no_stop_trim=True, prompt_tail_ids=[]) == "hello world. the end"
    token_reason = {"type": "stop", "matched": eos}
    assert detok.step("c", ids + [eos], False, token_reason, prompt_tail_ids=[]) == "hello world. the end"
    untrimmed = detok.step("d", ids + [eos], False, token_reason, no_stop_trim=True, prompt_tail_ids=[])
    assert untrimmed.endswith("<|im_end|>")
    assert trim_matched_stop("abc", [1], None, False) == ("abc", [1])


def batch(rids, reasons, ids, tails, logprobs=None) -> BatchTokenIDOut:
    n = len(rids)
    return BatchTokenIDOut(
        rids=rids,
        finished_reasons=reasons,
        output_ids=ids,
        prompt_tail_ids=tails,
        prompt_tokens=[3] * n,
        cached_tokens=[0] * n,
        skip_special_tokens=[True] * n,
        no_stop_trim=[False] * n,
        output_token_logprobs=logprobs or [None] * n,
    )


def test_batch_messages_carry_what_is_new(tokenizer):
    """Ids come once each; the text out is what is new, and the whole text once finished."""
    ids = tokenizer.encode("hello world")
    detok = IncrementalDetokenizer(tokenizer)
    out = detok.handle_batch_token_id_out(
        batch(["x", "y"], [None, None], [ids[:1], ids[:1]], [[], []], [None, [-0.5]])
    )
    assert out.rids == ["x", "y"] and out.output_ids == [ids[:1], ids[:1]]
    assert out.output_strs == [full_decode(tokenizer, ids[:1])] * 2 and out.output_token_logprobs[1] == [-0.5]
    rest = ids[1:]
    out = detok.handle_batch_token_id_out(
        batch(
            ["x", "y"],
            [None, finish_length(len(ids))],
            [rest, rest],
            [None, None],
            [None, [-0.5] * len(rest)],
        )
    )
    assert out.output_strs == [
        full_decode(tokenizer, ids)[len(full_decode(tokenizer, ids[:1])) :],
        "hello world",
    ]
    assert out.output_ids == [rest, rest] and set(detok.status) == {"x"}


def test_first_output_without_the_prompt_tail_is_an_error(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    with pytest.raises(ValueError, match="prompt's tail"):
        detok.step("r", tokenizer.encode("hi"), True)


@pytest.fixture(scope="module")
def spm_tokenizer(tmp_path_factory):
    return build_spm_tokenizer(str(tmp_path_factory.mktemp("spm")))


def test_sentencepiece_first_token_keeps_its_leading_space(spm_tokenizer):
    tok = spm_tokenizer
    prompt = tok.encode("The capital of France is")
    output = tok.encode("The capital of France is Paris. The", add_special_tokens=False)[len(prompt) - 1 :]
    first = tok.decode(output[:1])  # decoded alone, the word loses its space
    assert tok.convert_ids_to_tokens(output[0]).startswith("▁") and first.startswith("Paris")
    tail = prompt[-INIT_INCREMENTAL_DETOKENIZATION_OFFSET:]
    texts = stream(IncrementalDetokenizer(tok), output, tail=tail)
    assert texts[0] == " " + first and texts[-1] == " Paris. The"
    detok = IncrementalDetokenizer(tok)
    final = detok.step("r", output, True, finish_length(len(output)), prompt_tail_ids=tail)
    assert final == " Paris. The"
    assert detok.step("s", output, True, finish_matched_str("."), prompt_tail_ids=tail) == " Paris"


def test_prompt_ending_inside_a_character_is_no_context(tokenizer):
    """A prompt given as ids may end inside a multi-byte character: those bytes are dropped from
    the context, so the output's text is not cut by the prompt's broken character."""
    ids = tokenizer.encode("a😀")
    detok = IncrementalDetokenizer(tokenizer)
    texts = stream(detok, tokenizer.encode(" b"), tail=ids[:-1])
    assert texts[-1] == full_decode(tokenizer, tokenizer.encode(" b"))
    assert detok.status["r"].prefix_len == 1


@pytest.mark.parametrize("skip", [True, False])
def test_fast_decoder_equals_transformers(tokenizer, tok_dir, skip):
    decoder = FastDecoder(str(tok_dir / "tokenizer.json"))
    rng = random.Random(1)
    for _ in range(50):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 30))]
        assert decoder.decode(ids, skip) == full_decode(tokenizer, ids, skip)
