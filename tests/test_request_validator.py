"""RequestValidator, the one place a generate request is checked before the scheduler: with the
bundled model's real tokenizer and limits like the scheduler's, each bad prompt is a RequestError
(400) naming the field, whatever the prompt's kind (text, chat messages or input ids)."""

from __future__ import annotations

import pytest

from radixengine.managers.io_struct import GenerateReqInput
from radixengine.managers.request_errors import RequestError
from radixengine.managers.request_validator import RequestLimits, RequestValidator


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
