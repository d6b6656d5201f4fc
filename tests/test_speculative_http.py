"""Speculative decoding through the real server and the official `openai` client (the server runs
the overlap loop with it): greedy answers equal transformers', streamed or not, n > 1;
meta_info.spec_verify_ct; the accept length in /get_server_info and /metrics; drafts that would
run past the end of the context; no KV leaked."""

from __future__ import annotations

import httpx
import openai
import pytest
from test_engine_utils import launch_test_server, stop_test_server
from test_http import API_KEY, AUTH, assert_idle_accounting, model_path, oracle, post  # noqa: F401

MAX_NEW = 40
CONTEXT = 128


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):  # noqa: F811
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--dtype", "float32", "--max-total-tokens", "16384", "--num-threads", "1", "--api-key", API_KEY]
    args += ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "6", "--enable-metrics"]
    args += ["--context-length", str(CONTEXT)]
    proc = launch_test_server(model_path, log, args)
    yield proc
    stop_test_server(proc)


def test_greedy_answers_equal_transformers(server, oracle):  # noqa: F811
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "one two three one two three one two three one two"}]
    _, expected = oracle(oracle.chat_ids(messages), MAX_NEW)
    kw = dict(
        model=model, messages=messages, max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True}
    )
    assert client.chat.completions.create(**kw).choices[0].message.content == expected
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert_idle_accounting(server)


def test_meta_info_server_info_and_metrics_report_speculation(server, oracle):  # noqa: F811
    ids = oracle.tok.encode("a b c a b c a b c a b")
    expected_ids, _ = oracle(ids, MAX_NEW)
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    body = post(server, "/generate", {"input_ids": ids, "sampling_params": params}).json()
    assert body["output_ids"] == expected_ids
    assert isinstance(body["meta_info"]["spec_verify_ct"], int) and body["meta_info"]["spec_verify_ct"] >= 1
    info = assert_idle_accounting(server)
    assert info["speculative_algorithm"] == "NGRAM" and info["avg_spec_accept_length"] >= 1.0
    metrics = httpx.get(server.base_url + "/metrics", headers=AUTH, timeout=30).text
    assert "sglang:spec_accept_length" in metrics


def test_a_stop_string_inside_an_accepted_run_cuts_the_text(server, oracle):  # noqa: F811
    """The stop string is checked after every token a verify step gives: the text ends where it
    starts, as without speculation."""
    ids = oracle.tok.encode("x y z x y z x y z x y z")
    _, expected = oracle(ids, MAX_NEW)
    stop = next(expected[i : i + 3] for i in range(4, len(expected) - 3) if expected[i : i + 3].strip())
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    body = post(server, "/generate", {"input_ids": ids, "sampling_params": params}).json()
    assert body["text"] == expected[: expected.index(stop)]
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert_idle_accounting(server)


def test_the_server_runs_the_overlap_loop_and_n_samples(server, oracle):  # noqa: F811
    """Speculation no longer turns the overlap loop off (--disable-overlap-schedule still does);
    n = 2 greedy choices are both transformers' answer."""
    assert "runs the CPU forward on a worker thread" in server.log.read_text()
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "red blue red blue red blue red blue red"}]
    _, expected = oracle(oracle.chat_ids(messages), MAX_NEW)
    kw = dict(
        model=model, messages=messages, max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True}
    )
    choices = client.chat.completions.create(n=2, **kw).choices
    assert [c.message.content for c in choices] == [expected, expected]
    assert_idle_accounting(server)


def test_drafts_near_the_end_of_the_context_stay_inside_it(server, oracle):  # noqa: F811
    """A prompt and max_new_tokens that reach the end of the context (101 + 26 of 128): the last
    verify steps draft only as far as the request may still go; the answer is transformers'. The
    prompt is the tail of the model's own greedy text, which repeats: the drafts hold."""
    ids = (oracle(oracle.tok.encode("a b c d a b c d "), 100)[0] * 2)[-101:]
    max_new = CONTEXT - 1 - len(ids)
    expected_ids, expected = oracle(ids, max_new)
    params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    out = post(server, "/generate", {"input_ids": ids, "sampling_params": params}).json()
    assert out["output_ids"] == expected_ids and out["meta_info"]["spec_verify_ct"] >= 1
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    kw = dict(model=model, prompt=ids, max_tokens=max_new, temperature=0, extra_body={"ignore_eos": True})
    assert client.completions.create(**kw).choices[0].text == expected
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert_idle_accounting(server)
