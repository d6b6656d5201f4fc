"""GenerateReqInput.normalize_batch_and_arguments, the one normalisation of every front end's
generate call (Engine.generate / async_generate and HTTP /generate): single vs batch, n samples,
text vs ids vs chat messages, per-prompt fields, rids; and its errors, each a RequestError (a 400)
naming the field."""

from __future__ import annotations

import pytest

from radixengine.entrypoints.native_routes import native_requests
from radixengine.managers.io_struct import GenerateReqInput
from radixengine.managers.request_errors import RequestError


def normalize(**fields) -> tuple[list[GenerateReqInput], bool]:
    return GenerateReqInput(**fields).normalize_batch_and_arguments()


def test_a_single_text_prompt_is_one_request_and_a_single_answer():
    reqs, single = normalize(text="hi", sampling_params={"max_new_tokens": 2}, rid="r", return_logprob=True)
    assert single and len(reqs) == 1
    assert (reqs[0].text, reqs[0].input_ids, reqs[0].rid) == ("hi", None, "r")
    assert reqs[0].sampling_params == {"max_new_tokens": 2} and reqs[0].return_logprob is True


@pytest.mark.parametrize(
    "kind,one,batch",
    [
        ("input_ids", [1, 2, 3], [[1, 2], [3]]),
        ("messages", [{"role": "user", "content": "a"}], [[{"role": "user", "content": "a"}]] * 2),
        ("text", "a", ["a", "b"]),
    ],
)
def test_single_and_batch_of_each_prompt_kind(kind, one, batch):
    reqs, single = normalize(**{kind: one})
    assert single and [getattr(r, kind) for r in reqs] == [one]
    reqs, single = normalize(**{kind: batch})
    assert not single and [getattr(r, kind) for r in reqs] == list(batch)
    others = {"text", "input_ids", "messages"} - {kind}
    assert all(getattr(r, name) is None for r in reqs for name in others)


def test_a_batch_of_one_prompt_still_answers_a_list():
    reqs, single = normalize(text=["a"])
    assert not single and len(reqs) == 1


def test_n_samples_expand_prompt_by_prompt_with_seed_plus_j_and_rid_suffixes():
    params = {"n": 2, "sampling_seed": 7, "temperature": 0.5}
    reqs, single = normalize(text=["a", "b"], sampling_params=params, rid=["x", "y"], priority=[1, 2])
    assert not single
    assert [(r.text, r.rid, r.priority) for r in reqs] == [
        ("a", "x_0", 1), ("a", "x_1", 1), ("b", "y_0", 2), ("b", "y_1", 2)
    ]  # fmt: skip
    assert [r.sampling_params["sampling_seed"] for r in reqs] == [7, 8, 7, 8]
    assert all(r.sampling_params["n"] == 1 and r.sampling_params["temperature"] == 0.5 for r in reqs)
    assert params == {"n": 2, "sampling_seed": 7, "temperature": 0.5}, "the caller's params are not changed"


def test_n_of_one_prompt_answers_a_list_and_a_string_rid_is_suffixed():
    reqs, single = normalize(input_ids=[5, 6], sampling_params={"n": 3}, rid="r")
    assert not single and [r.rid for r in reqs] == ["r_0", "r_1", "r_2"]
    assert all(r.input_ids == [5, 6] for r in reqs)
    reqs, _ = normalize(text=["a", "b"], rid="batch")
    assert [r.rid for r in reqs] == ["batch_0", "batch_1"]


def test_per_prompt_fields_are_given_once_or_one_per_prompt():
    reqs, _ = normalize(
        text=["a", "b"],
        sampling_params=[{"max_new_tokens": 1}, {"max_new_tokens": 2}],
        return_logprob=[True, False],
        top_logprobs_num=3,
        logprob_start_len=[0, -1],
        stream=True,
    )
    assert [r.sampling_params["max_new_tokens"] for r in reqs] == [1, 2]
    assert [(r.return_logprob, r.top_logprobs_num, r.logprob_start_len, r.stream) for r in reqs] == [
        (True, 3, 0, True), (False, 3, -1, True)
    ]  # fmt: skip


def test_routing_key_is_one_for_every_prompt_or_one_per_prompt():
    reqs, _ = normalize(text=["a", "b"], sampling_params={"n": 2}, routing_key=["t1", "t2"])
    assert [r.routing_key for r in reqs] == ["t1", "t1", "t2", "t2"]
    reqs, _ = normalize(text=["a", "b"], routing_key="t")
    assert [r.routing_key for r in reqs] == ["t", "t"]


@pytest.mark.parametrize(
    "fields,param",
    [
        ({}, "text"),
        ({"text": "a", "input_ids": [1]}, "text"),
        ({"text": []}, "text"),
        ({"text": 5}, "text"),
        ({"input_ids": [[1]], "messages": [[{"role": "user"}]]}, "text"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
        ({"text": "a", "sampling_params": "hot"}, "sampling_params"),
        ({"text": "a", "sampling_params": {"n": 0}}, "n"),
        ({"text": "a", "sampling_params": {"n": True}}, "n"),
        ({"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 1}]}, "n"),
        ({"text": ["a", "b"], "priority": [1, 2, 3]}, "priority"),
        ({"text": ["a", "b"], "routing_key": ["t"]}, "routing_key"),
        ({"text": ["a", "b"], "top_logprobs_num": [1]}, "top_logprobs_num"),
        ({"text": "a", "rid": ["a"]}, "rid"),
        ({"text": "a", "rid": 5}, "rid"),
        ({"text": ["a", "b"], "rid": ["x", 5]}, "rid"),
        ({"text": ["a", "b"], "rid": ["x"]}, "rid"),
        ({"text": "a", "stream": "yes"}, "stream"),
        ({"text": "a", "log_metrics": "no"}, "log_metrics"),
        ({"text": "a", "return_text_in_logprobs": 1}, "return_text_in_logprobs"),
        ({"text": "a", "sampling_params": {"n": 129}}, "n"),
        ({"text": ["a"] * 4097}, "text"),
        ({"input_ids": [[1]] * 4097}, "input_ids"),
        ({"text": ["a"] * 33, "sampling_params": {"n": 128}}, "n"),
    ],
)
def test_bad_shapes_are_request_errors_naming_the_field(fields, param):
    with pytest.raises(RequestError) as e:
        normalize(**fields)
    assert e.value.param == param and e.value.status_code == 400


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"text": ["a", None]}, "text[1] must be a string, got None"),
        ({"text": ["a", 5]}, "text[1] must be a string, got int"),
        ({"text": [None, "a"]}, "text[0] must be a string, got None"),
        ({"input_ids": [[1], None]}, "input_ids[1] must be a list, got None"),
        ({"messages": [[{"role": "user", "content": "a"}], None]}, "messages[1] must be a list, got None"),
    ],
)
def test_a_batch_item_of_the_wrong_type_is_named_by_its_index(fields, message):
    """Not "give exactly one of text or input_ids" for a None in a batch of texts: the item is named."""
    with pytest.raises(RequestError) as e:
        normalize(**fields)
    assert e.value.message == message and e.value.param == next(iter(fields))


def test_the_http_body_goes_through_the_same_normalisation():
    reqs, single = native_requests(
        {"text": "hi", "sampling_params": {"n": 2}, "rid": "h", "model": "m", "no_logs": True, "unknown": 1}
    )
    assert not single and [r.rid for r in reqs] == ["h_0", "h_1"]
    with pytest.raises(RequestError) as e:
        native_requests({"text": "hi", "no_logs": "x"})
    assert e.value.param == "no_logs"
    with pytest.raises(RequestError) as e:
        native_requests({"input_ids": [1], "text": "hi"})
    assert e.value.param == "text"


def test_the_largest_fan_out_is_allowed():
    """n up to 128 (OpenAI's maximum), prompts x n up to 4096 requests."""
    assert len(normalize(text="a", sampling_params={"n": 128})[0]) == 128
    assert len(normalize(text=["a"] * 32, sampling_params={"n": 128})[0]) == 4096
    assert len(normalize(input_ids=[[1]] * 4096)[0]) == 4096
