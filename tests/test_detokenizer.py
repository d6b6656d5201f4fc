"""Incremental detokenization: UTF-8 safe, equal to a full decode, special tokens, stop trimming."""

from __future__ import annotations

import random

import pytest
from test_engine_utils import build_tokenizer

from radixengine.managers.detokenizer_manager import FastDecoder, IncrementalDetokenizer, trim_matched_stop
from radixengine.managers.io_struct import BatchTokenIDOut, finish_length, finish_matched_str

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


def stream(detok: IncrementalDetokenizer, ids: list[int], skip=True) -> list[str]:
    return [detok.step("r", ids[: i + 1], skip) for i in range(len(ids))]


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
    final = detok.step("r", ids, True, finish_length(len(ids)))
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
        seen = [detok.step(rid, ids[: i + 1], True) for i in range(len(ids))]
        final = detok.step(rid, ids, True, finish_length(len(ids)))
        assert final == full_decode(tokenizer, ids)
        for t in seen:
            assert final.startswith(t)
            assert not t.endswith("\ufffd")
    assert detok.status == {}


def test_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("hello") + [tokenizer.convert_tokens_to_ids("<|im_end|>")] + tokenizer.encode(" world")
    detok = IncrementalDetokenizer(tokenizer)
    assert stream(detok, ids, skip=True)[-1] == "hello world"
    detok = IncrementalDetokenizer(tokenizer)
    assert stream(detok, ids, skip=False)[-1] == "hello<|im_end|> world"


def test_stop_trimming(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("hello world. the end")
    detok = IncrementalDetokenizer(tokenizer)
    reason = finish_matched_str("world")
    assert detok.step("a", ids, True, reason) == "hello "
    assert detok.step("b", ids, True, reason, no_stop_trim=True) == "hello world. the end"
    token_reason = {"type": "stop", "matched": eos}
    assert detok.step("c", ids + [eos], False, token_reason) == "hello world. the end"
    assert detok.step("d", ids + [eos], False, token_reason, no_stop_trim=True).endswith("<|im_end|>")
    assert trim_matched_stop("abc", [1], None, False) == ("abc", [1])


def test_batch_message(tokenizer):
    ids = tokenizer.encode("hello world")
    detok = IncrementalDetokenizer(tokenizer)
    recv = BatchTokenIDOut(
        rids=["x", "y"],
        finished_reasons=[None, finish_length(len(ids))],
        output_ids=[ids[:1], ids],
        prompt_tokens=[3, 4],
        cached_tokens=[0, 2],
        skip_special_tokens=[True, True],
        no_stop_trim=[False, False],
        output_token_logprobs=[None, [-0.5] * len(ids)],
    )
    out = detok.handle_batch_token_id_out(recv)
    assert out.rids == ["x", "y"]
    assert out.output_strs == [full_decode(tokenizer, ids[:1]), "hello world"]
    assert out.cached_tokens == [0, 2] and out.output_token_logprobs[1] == [-0.5] * len(ids)
    assert set(detok.status) == {"x"}


@pytest.mark.parametrize("skip", [True, False])
def test_fast_decoder_equals_transformers(tokenizer, tok_dir, skip):
    decoder = FastDecoder(str(tok_dir / "tokenizer.json"))
    rng = random.Random(1)
    for _ in range(50):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 30))]
        assert decoder.decode(ids, skip) == full_decode(tokenizer, ids, skip)
