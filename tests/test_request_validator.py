"""RequestValidator, the one place a generate request is checked before the scheduler: with the
bundled model's real tokenizer and limits like the scheduler's, each bad prompt is a RequestError
(400) naming the field, whatever the prompt's kind (text, chat messages or input ids)."""

from __future__ import annotations

import pytest

from radixengine.managers.io_struct import GenerateReqInput
from radixengine.managers.request_errors import RequestError
from radixengine.managers.request_validator import RequestLimits, RequestValidator
from radixengine.managers.served_model import max_chars_per_token


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    from radixengine.model_loader import get_tokenizer

    return get_tokenizer(gguf_path)


def validator(tokenizer, **limits) -> RequestValidator:
    info = {"context_len": 256, "max_req_input_len": 200, "max_req_len": 256, **limits}
    return RequestValidator(tokenizer, RequestLimits.from_scheduler_info(info, tokenizer), "xgrammar")


def refusal(v: RequestValidator, **fields) -> RequestError:
    with pytest.raises(RequestError) as e:
        v.tokenize_request(GenerateReqInput(**fields), "r")
    assert e.value.status_code == 400
    return e.value


def test_a_good_request_is_tokenized_for_the_scheduler(tokenizer):
    out = validator(tokenizer).tokenize_request(
        GenerateReqInput(text="hello world", sampling_params={"max_new_tokens": 4}, routing_key="t"), "r"
    )
    assert out.rid == "r" and out.input_ids == tokenizer.encode("hello world") and out.routing_key == "t"
    assert out.sampling_params.max_new_tokens == 4 and out.top_logprobs_num == 0


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1] * 200}, "input_ids"),
        ({"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 250}}, "max_new_tokens"),
        ({"text": "hello " * 250}, "text"),
        ({"input_ids": [-1]}, "input_ids"),
        ({"input_ids": [1, "a"]}, "input_ids"),
        ({"messages": []}, "messages"),
        ({"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
        ({"text": "hi", "priority": "high"}, "priority"),
        ({"text": "hi", "routing_key": 7}, "routing_key"),
        ({"text": "hi", "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
    ],
)
def test_bad_prompts_are_refused_naming_the_field(tokenizer, fields, param):
    assert refusal(validator(tokenizer), **fields).param == param


def test_ids_of_a_tokenized_text_outside_the_models_vocabulary_are_refused(tokenizer):
    """A tokenizer may know more tokens than the model: a text whose tokens the model has no
    embedding for is a 400 here, not a failure in the scheduler."""
    ids = tokenizer.encode("hello world")
    small = validator(tokenizer, vocab_size=min(ids))
    assert refusal(small, text="hello world").param == "text"
    assert refusal(small, input_ids=ids).param == "input_ids"
    assert validator(tokenizer, vocab_size=max(ids) + 1).tokenize_request(
        GenerateReqInput(input_ids=ids), "r"
    )


@pytest.mark.parametrize(
    "fields,rid,param",
    [
        ({"text": "a\ud800b"}, "r", "text"),
        ({"messages": [{"role": "user", "content": "\udfff"}]}, "r", "messages[0].content"),
        ({"text": "hi", "sampling_params": {"stop": "\ud800"}}, "r", "stop"),
        ({"text": "hi", "sampling_params": {"stop": ["x", "\ud800"]}}, "r", "stop[1]"),
        ({"text": "hi", "sampling_params": {"regex": "a\udc00"}}, "r", "regex"),
        ({"text": "hi", "routing_key": "\ud800"}, "r", "routing_key"),
        ({"text": "hi"}, "\ud800", "rid"),
    ],
)
def test_a_lone_surrogate_in_any_string_is_refused_naming_its_path(tokenizer, fields, rid, param):
    """JSON's "\\ud800" escape gives a string UTF-8 cannot encode: refused here, before the
    tokenizer (a TypeError) or the scheduler's stop-string window sees it."""
    with pytest.raises(RequestError) as e:
        validator(tokenizer).tokenize_request(GenerateReqInput(**fields), rid)
    assert e.value.status_code == 400 and e.value.param == param and "surrogate" in e.value.message


def test_a_text_too_long_for_any_tokenization_is_refused_before_tokenizing(tokenizer):
    """No token of the vocabulary covers more than L characters (its longest token string), so a
    text of more than (max input tokens) x L characters cannot fit: refused by its length alone.
    One character less is tokenized (and refused by its token count)."""
    per_token = max(len(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
    bound = 199 * per_token  # max_req_input_len 200: at most 199 prompt tokens
    over = refusal(validator(tokenizer), text="a" * (bound + 1))
    assert over.param == "text" and f"{bound + 1} characters" in over.message
    at = refusal(validator(tokenizer), text="a" * bound)
    assert at.param == "text" and "tokens, the maximum is 199" in at.message
    chat = refusal(validator(tokenizer), messages=[{"role": "user", "content": "a" * (bound + 1)}])
    assert chat.param == "messages" and "characters" in chat.message
    fits = validator(tokenizer).tokenize_request(GenerateReqInput(text="hello " * 30), "r")
    assert fits.input_ids == tokenizer.encode("hello " * 30)


def test_an_implicit_max_new_tokens_is_clipped_to_the_room_left(tokenizer):
    """SGLang's rule: the default 128 new tokens shrinks to what the context leaves (max_req_len
    256 here); an explicit max_new_tokens past it stays a 400."""
    v = validator(tokenizer)
    for params in (None, {}, {"temperature": 0}):
        out = v.tokenize_request(GenerateReqInput(input_ids=[1] * 190, sampling_params=params), "r")
        assert out.sampling_params.max_new_tokens == 256 - 190
    short = v.tokenize_request(GenerateReqInput(input_ids=[1] * 10), "r")
    assert short.sampling_params.max_new_tokens == 128
    explicit = refusal(v, input_ids=[1] * 190, sampling_params={"max_new_tokens": 128})
    assert explicit.param == "max_new_tokens"


def test_the_characters_a_token_can_cover_come_from_the_vocabulary(tmp_path):
    """L is the longest token string (a byte-level token's: a character per byte), times 4 under a
    composing normalizer; none where a token may cover any number of characters."""
    from test_engine_utils import build_tokenizer
    from tokenizers import normalizers, pre_tokenizers

    tok = build_tokenizer(str(tmp_path))
    longest = max(len(t) for t in tok.convert_ids_to_tokens(list(range(len(tok)))))
    assert max_chars_per_token(tok) == longest
    tok.backend_tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(" ", "_")]
    )
    assert max_chars_per_token(tok) == 4 * longest
    tok.backend_tokenizer.normalizer = normalizers.Strip()
    assert max_chars_per_token(tok) is None
    tok.backend_tokenizer.normalizer = None
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # drops runs of spaces
    assert max_chars_per_token(tok) is None
