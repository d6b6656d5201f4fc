"""The HTTP server, started for real (`python -m radixengine.launch_server`) on a free loopback port
with a tiny random Llama: the official openai client (chat and completions, streaming and not,
stop sequences, n=2, logprobs), 64 concurrent streams, a client that disconnects, bad input,
/metrics, the API key, and a clean SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import psutil
import pytest
import torch
from test_engine_utils import (
    build_tiny_model,
    children_paused,
    hf_greedy,
    launch_test_server,
    load_hf_model,
    raw_post,
    read_until,
    stop_test_server,
    wait_for_idle_accounting,
    wait_gone,
    wait_until,
)

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_NEW = 10
CONTEXT = 1024


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_llama")), max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--dtype", "float32", "--max-total-tokens", "16384", "--num-threads", "1", "--api-key", API_KEY]
    proc = launch_test_server(model_path, log, args)
    yield proc
    stop_test_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def oracle(model_path):
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    hf = load_hf_model(model_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_path)

    def chat_ids(messages):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok.encode(text, add_special_tokens=False)

    def run(ids: list[int], n: int = MAX_NEW) -> tuple[list[int], str]:
        out = hf_greedy(hf, [ids], n)[0]
        return out, tok.decode(out, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    run.tok, run.chat_ids = tok, chat_ids
    return run


def get(server, path: str, **kw) -> httpx.Response:
    return httpx.get(server.base_url + path, headers=AUTH, timeout=60, **kw)


def post(server, path: str, body=None, content=None) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, content=content, headers=AUTH, timeout=60)


def assert_idle_accounting(server, timeout: float = 20.0) -> dict:
    return wait_for_idle_accounting(lambda: get(server, "/get_server_info").json(), timeout)


MESSAGES = [{"role": "user", "content": "hello world this is a test"}]


def test_ready_line_health_and_api_key(server):
    # The ready line is logged once the server answered its own warm-up request; give it time.
    deadline = time.monotonic() + 30
    while "ready to roll" not in server.log.read_text():
        assert time.monotonic() < deadline, server.log.read_text()
        time.sleep(0.2)
    # The probes are outside the key (as in SGLang); everything else needs it. Metrics are off
    # here: /metrics answers its 404, not the key's 401.
    for path in ("/health", "/health_generate"):
        assert httpx.get(server.base_url + path).status_code == 200, path
    assert httpx.get(server.base_url + "/metrics").status_code == 404
    for path in ("/v1/models", "/get_server_info", "/server_info", "/model_info", "/v1/loads"):
        r = httpx.get(server.base_url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        r = httpx.get(server.base_url + path, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
    r = httpx.post(server.base_url + "/generate", json={"text": "hi"})
    assert r.status_code == 401
    assert get(server, "/health_generate").status_code == 200
    bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_chat_completion_matches_transformers(client, model_name, oracle):
    ids = oracle.chat_ids(MESSAGES)
    _, expected = oracle(ids)
    r = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=MAX_NEW,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == MAX_NEW
    assert r.usage.prompt_tokens_details.cached_tokens >= 0

    stream = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=MAX_NEW, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "priority": 3},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == MAX_NEW
    # The second identical request is served from the radix cache.
    assert usage.prompt_tokens_details.cached_tokens == len(ids) - 1


def test_completions_stop_n_and_logprobs(client, model_name, oracle):
    prompt = "Once upon a time there was"
    ids = oracle.tok.encode(prompt)
    _, expected = oracle(ids)
    r = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=MAX_NEW, temperature=0, logprobs=1, n=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.text for c in r.choices] == [expected, expected]
    assert [c.index for c in r.choices] == [0, 1]
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == MAX_NEW and all(x <= 0 for x in lp.token_logprobs)
    assert "".join(lp.tokens) == expected or len(lp.tokens) == MAX_NEW
    assert r.usage.completion_tokens == 2 * MAX_NEW and r.usage.prompt_tokens == len(ids)

    stop = expected[len(expected) // 2 : len(expected) // 2 + 2]
    r = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=MAX_NEW, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == expected[: expected.find(stop)]
    assert r.choices[0].finish_reason == "stop"

    stream = client.completions.create(
        model=model_name, prompt=ids, max_tokens=MAX_NEW, temperature=0, stream=True, logprobs=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    pieces = list(stream)
    assert "".join(p.choices[0].text for p in pieces) == expected
    assert sum(len(p.choices[0].logprobs.token_logprobs) for p in pieces) == MAX_NEW


def test_native_generate(server, oracle):
    ids = oracle.tok.encode("hello world")
    expected_ids, expected = oracle(ids)
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    r = post(server, "/generate", {"text": "hello world", "sampling_params": params, "rid": "native-1"})
    body = r.json()
    assert r.status_code == 200 and body["text"] == expected and body["output_ids"] == expected_ids
    assert body["meta_info"]["id"] == "native-1" and body["meta_info"]["completion_tokens"] == MAX_NEW
    r = post(server, "/generate", {"input_ids": [ids, ids], "sampling_params": params, "priority": 1})
    assert [o["output_ids"] for o in r.json()] == [expected_ids, expected_ids]
    with httpx.stream("POST", server.base_url + "/generate", headers=AUTH, timeout=60,
                      json={"text": "hello world", "sampling_params": params, "stream": True}) as resp:  # fmt: skip
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["text"] == expected


def sse_events(server, body: dict) -> list[dict]:
    with httpx.stream("POST", server.base_url + "/generate", headers=AUTH, timeout=60, json=body) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_native_generate_n_samples_and_batch_rids(server, oracle):
    """SGLang's /generate: n > 1 answers a list (prompt by prompt, n samples each); a string rid
    for several requests is suffixed _k, a list gives one per prompt."""
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    hello_ids, hello = oracle(oracle.tok.encode("hello world"))
    once_ids, _ = oracle(oracle.tok.encode("Once upon a time"))
    r = post(server, "/generate", {"text": "hello world", "sampling_params": {**params, "n": 2}, "rid": "nn"})
    assert r.status_code == 200, r.text
    assert [o["text"] for o in r.json()] == [hello, hello]
    assert [o["meta_info"]["id"] for o in r.json()] == ["nn_0", "nn_1"]
    body = {
        "text": ["hello world", "Once upon a time"],
        "sampling_params": {**params, "n": 2},
        "rid": ["a", "b"],
    }
    outs = post(server, "/generate", body).json()
    assert [o["output_ids"] for o in outs] == [hello_ids, hello_ids, once_ids, once_ids]
    assert [o["meta_info"]["id"] for o in outs] == ["a_0", "a_1", "b_0", "b_1"]
    outs = post(
        server, "/generate", {"text": ["hello world"] * 2, "sampling_params": params, "rid": "batch"}
    ).json()
    assert [o["meta_info"]["id"] for o in outs] == ["batch_0", "batch_1"]
    assert [o["output_ids"] for o in outs] == [hello_ids, hello_ids]
    events = sse_events(
        server, {"text": "hello world", "sampling_params": {**params, "n": 2}, "stream": True}
    )
    finals = {e["index"]: e["text"] for e in events if e["meta_info"]["finish_reason"]}
    assert finals == {0: hello, 1: hello}
    assert_idle_accounting(server)


def test_completions_echo_streaming(client, model_name, oracle):
    """echo puts the prompt before the completion: in a streamed choice, in its first chunk."""
    prompt = "Once upon a time there was"
    ids = oracle.tok.encode(prompt)
    _, expected = oracle(ids)
    decoded = oracle.tok.decode(ids, skip_special_tokens=True)
    for given, echoed, n in ((prompt, prompt, 1), (prompt, prompt, 2), (ids, decoded, 1)):
        kwargs = dict(model=model_name, prompt=given, max_tokens=MAX_NEW, temperature=0, echo=True, n=n,
                      extra_body={"ignore_eos": True})  # fmt: skip
        texts: dict[int, list[str]] = {}
        for chunk in client.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                texts.setdefault(choice.index, []).append(choice.text)
        assert sorted(texts) == list(range(n))
        for pieces in texts.values():
            assert pieces[0].startswith(echoed) and "".join(pieces) == echoed + expected
        whole = client.completions.create(**kwargs)
        assert [c.text for c in whole.choices] == [echoed + expected] * n


@pytest.mark.parametrize("echo", [False, True], ids=["completion", "echo"])
def test_completions_streamed_text_offsets_match_the_whole_answer(client, model_name, echo):
    """text_offset counts from the start of the text the client gets (echoed prompt included), in
    a stream as in the whole answer: a chunk's offsets go on from where the previous chunk's
    tokens end."""
    kwargs = dict(model=model_name, prompt="The sky is", max_tokens=5, temperature=0, logprobs=1, echo=echo,
                  n=2, extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.completions.create(**kwargs)
    streamed: dict[int, dict[str, list]] = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            got = streamed.setdefault(choice.index, {"tokens": [], "text_offset": []})
            if choice.logprobs is not None:
                got["tokens"] += choice.logprobs.tokens
                got["text_offset"] += choice.logprobs.text_offset
    assert sorted(streamed) == [0, 1]
    for choice in whole.choices:
        offsets = choice.logprobs.text_offset
        echoed = whole.usage.prompt_tokens if echo else 0
        assert offsets[0] == 0 and len(offsets) == len(choice.logprobs.tokens) == echoed + 5
        assert streamed[choice.index] == {"tokens": choice.logprobs.tokens, "text_offset": offsets}


def test_64_concurrent_streams(server, model_name):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int]:
        stream = await client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": f"request {i}: hello"}], max_tokens=8,
            temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        n_chunks, usage = 0, None
        async for chunk in stream:
            n_chunks += bool(chunk.choices)
            usage = chunk.usage or usage
        return n_chunks, usage.completion_tokens

    async def main():
        client = openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120
        )
        return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert all(tokens == 8 for _, tokens in results)
    assert all(n_chunks >= 2 for n_chunks, _ in results)
    assert_idle_accounting(server)


def rid_taken(server, rid: str) -> bool:
    """Whether the server holds a request with this rid: the rid is checked before anything else,
    so a probe with a bad parameter is refused for its rid (taken) or for the parameter (free),
    and never runs."""
    r = post(server, "/generate", {"text": "probe", "rid": rid, "sampling_params": {"temperature": -1}})
    assert r.status_code == 400, r.text
    return r.json()["error"]["param"] == "rid"


LONG = {"max_new_tokens": 900, "ignore_eos": True}


@pytest.mark.parametrize("stream", [False, True], ids=["non_streaming", "streaming"])
def test_client_that_leaves_before_any_output_aborts_its_request(server, stream):
    """A client that leaves while its request waits (here: the scheduler is stopped) gets the
    request aborted at once; the request never runs to its end, and its rid is free again once
    the scheduler finished it."""
    rid = f"left-early-{stream}"
    before = get(server, "/get_server_info").json()["num_generated_tokens"]
    with children_paused(server):
        body = {"text": "a long one", "sampling_params": LONG, "rid": rid, "stream": stream}
        sock = raw_post(server, "/generate", body, api_key=API_KEY)
        wait_until(lambda: rid_taken(server, rid), "the request did not reach the server")
        sock.close()
        wait_until(
            lambda: f"client disconnected; aborted request(s) {rid}" in server.log.read_text(), "no abort"
        )
    info = assert_idle_accounting(server)
    assert info["num_generated_tokens"] - before < LONG["max_new_tokens"], "the request ran to the end"
    wait_until(lambda: not rid_taken(server, rid), "the aborted request's rid stayed taken")


def test_disconnect_mid_stream_aborts_and_frees(server):
    rid = "left-mid-stream"
    before = get(server, "/get_server_info").json()["num_generated_tokens"]
    body = {"text": "a long one", "sampling_params": LONG, "rid": rid, "stream": True}
    sock = raw_post(server, "/generate", body, api_key=API_KEY)
    read_until(sock, b"data: ")  # the stream has started
    with children_paused(server):  # no more tokens while the server notices the client left
        sock.close()
        marker = f"client disconnected mid-stream; aborted request(s) {rid}"
        wait_until(lambda: marker in server.log.read_text(), "no abort")
    info = assert_idle_accounting(server)
    assert info["num_generated_tokens"] - before < LONG["max_new_tokens"], "the request ran to the end"
    wait_until(lambda: not rid_taken(server, rid), "the aborted request's rid stayed taken")


BAD_INPUTS = [
    ("/v1/chat/completions", b'{"model": ', "body"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": MESSAGES, "max_tokens": "5"}, "max_tokens"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": MESSAGES, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"model": 5, "messages": MESSAGES}, "model"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": "hi"}, "messages"),
    (
        "/v1/chat/completions",
        {"model": "MODEL", "messages": [{"role": "wizard", "content": "x"}]},
        "messages[0].role",
    ),
    ("/v1/chat/completions", {"model": "MODEL", "messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": MESSAGES, "max_tokens": -3}, "max_tokens"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": MESSAGES, "max_tokens": CONTEXT}, "max_tokens"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": MESSAGES, "temperature": -0.5}, "temperature"),
    (
        "/v1/chat/completions",
        {"model": "MODEL", "messages": MESSAGES, "frequency_penalty": 2.5},
        "frequency_penalty",
    ),
    ("/v1/completions", {"model": "MODEL", "prompt": "hi", "presence_penalty": -3}, "presence_penalty"),
    ("/v1/completions", {"model": "MODEL", "prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": MESSAGES, "logit_bias": {"x": 1}}, "logit_bias"),
    (
        "/v1/chat/completions",
        {"model": "MODEL", "messages": MESSAGES, "logit_bias": {"5": 150}},
        "logit_bias",
    ),
    ("/v1/completions", {"model": "MODEL", "prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"99999": 1}}}, "logit_bias"),
    ("/generate", {"text": "hi", "sampling_params": {"repetition_penalty": 2.5}}, "repetition_penalty"),
    (
        "/v1/chat/completions",
        {"model": "MODEL", "messages": MESSAGES, "return_hidden_states": True},
        "return_hidden_states",
    ),
    (
        "/v1/chat/completions",
        {
            "model": "MODEL",
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        },
        "messages[0].content[0].type",
    ),
    ("/generate", {"text": "hi", "return_entropy": True}, "return_entropy"),
    ("/generate", {"text": "hi", "log_metrics": "no"}, "log_metrics"),
    (
        "/v1/chat/completions",
        {"model": "MODEL", "messages": MESSAGES, "stream": True, "max_tokens": 0},
        "max_tokens",
    ),
    ("/v1/completions", {"model": "MODEL", "prompt": "hello " * 3000}, "prompt"),
    ("/v1/completions", {"model": "MODEL", "prompt": [5] * CONTEXT, "stream": True}, "prompt"),
    ("/v1/completions", {"model": "MODEL", "prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"model": "MODEL", "prompt": 5}, "prompt"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokenz": 3}}, "max_new_tokenz"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
    ("/generate", {"input_ids": [10**7]}, "input_ids"),
    ("/generate", {"text": "hi", "priority": "high"}, "priority"),
    ("/generate", {"text": "hi", "rid": {"a": 1}}, "rid"),
    ("/generate", {"text": "hi", "rid": ["a"]}, "rid"),
    ("/generate", {"text": ["a", "b"], "rid": ["x", 5]}, "rid"),
    ("/generate", {"text": ["a", "b"], "rid": ["x"]}, "rid"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 0}}, "n"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 1}]}, "n"),
    ("/generate", {"text": "hi", "top_logprobs_num": -1}, "top_logprobs_num"),
    ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
    ("/generate", {"text": ["a", "b"], "top_logprobs_num": [1]}, "top_logprobs_num"),
    ("/v1/completions", {"model": "MODEL", "prompt": "hi", "logprobs": 21}, "logprobs"),
    (
        "/v1/chat/completions",
        {
            "model": "MODEL",
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 21,
        },
        "top_logprobs",
    ),  # fmt: skip
    ("/v1/completions", {"model": "MODEL", "prompt": "hi", "rid": {"a": 1}}, "rid"),
    # A lone UTF-16 surrogate (JSON's "\ud800" escape) in any string, the field named by its path
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "stop": "\\ud800"}', "stop"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "\\udc00": 1}', "body"),
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 3}', "prompt"),
    ("/v1/completions", b'{"model": "\\ud800", "prompt": "hi", "max_tokens": 3}', "model"),
    ("/generate", b'{"text": "hi", "sampling_params": {"stop": "\\ud800"}}', "sampling_params.stop"),
    ("/generate", b'{"text": "a\\ud800b"}', "text"),
    ("/generate", b'{"text": "hi", "rid": "\\ud800", "sampling_params": {"max_new_tokens": 2}}', "rid"),
    ("/tokenize", b'{"prompt": "a\\ud800b"}', "prompt"),
    # JSON nested past the parser's depth
    ("/v1/chat/completions", b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", "body"),
    ("/generate", b'{"text": ' + b"[" * 5000 + b"]" * 5000 + b"}", "body"),
    # n at most 128, at most 4096 requests (prompts x n) in one call
    ("/v1/chat/completions", {"model": "MODEL", "messages": MESSAGES, "max_tokens": 1, "n": 129}, "n"),
    ("/v1/completions", {"model": "MODEL", "prompt": "hi", "max_tokens": 1, "n": 129}, "n"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1, "n": 129}}, "n"),
    ("/v1/completions", {"model": "MODEL", "prompt": ["hi"] * 4097, "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"model": "MODEL", "prompt": ["hi"] * 33, "max_tokens": 1, "n": 128}, "n"),
    ("/generate", {"input_ids": [[5]] * 4097, "sampling_params": {"max_new_tokens": 1}}, "input_ids"),
    ("/tokenize", {"prompt": ["hi"] * 4097}, "prompt"),
    # Non-finite floats
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "temperature": Infinity}', "temperature"),
    ("/generate", b'{"text": "hi", "sampling_params": {"temperature": NaN}}', "temperature"),
    ("/generate", b'{"text": "hi", "sampling_params": {"min_p": NaN}}', "min_p"),
    # OpenAI's rule: top_logprobs needs logprobs
    ("/v1/chat/completions", {"model": "MODEL", "messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
]  # fmt: skip


@pytest.mark.parametrize("route,body,param", BAD_INPUTS, ids=[f"{r}:{p}" for r, _, p in BAD_INPUTS])
def test_bad_input_gets_400_naming_the_field(server, model_name, route, body, param):
    if isinstance(body, bytes):
        r = post(server, route, content=body)
    else:
        r = post(server, route, json.loads(json.dumps(body).replace('"MODEL"', json.dumps(model_name))))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["code"] == 400 and err["type"]


def test_a_lone_surrogate_leaves_the_server_serving(server, client, model_name):
    """A stop string the tokenizer cannot take used to kill the scheduler: now a 400, and the next
    requests are served."""
    for route, body in (
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stop": "\\ud800"}'),
        ("/generate", b'{"text": "hi", "sampling_params": {"max_new_tokens": 3, "stop": ["a", "\\udfff"]}}'),
    ):  # fmt: skip
        r = post(server, route, content=body)
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=2, stop=["\U0001f600"])
    assert r.usage.completion_tokens <= 2
    assert_idle_accounting(server)


def test_a_prompt_longer_than_any_tokenization_is_refused_before_tokenizing(server, oracle):
    """No token covers more characters than the vocabulary's longest token string (L): a text
    of more than (max input tokens) x L characters is refused by its length, untokenized; one
    character less is tokenized (and refused by its token count)."""
    per_token = max(len(t) for t in oracle.tok.convert_ids_to_tokens(list(range(len(oracle.tok)))))
    max_input = get(server, "/get_server_info").json()["max_req_input_len"] - 1
    bound = max_input * per_token
    r = post(server, "/v1/completions", {"prompt": "a" * (bound + 1), "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert f"{bound + 1} characters" in r.json()["error"]["message"]
    r = post(server, "/generate", {"text": "a" * bound, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text"
    assert f"the maximum is {max_input}" in r.json()["error"]["message"]
    r = post(server, "/generate", {"text": "a" * 100, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200 and r.json()["meta_info"]["prompt_tokens"] > 0


def test_penalties_and_logit_bias(server, client, model_name, model_path, oracle):
    """The OpenAI routes and /generate take the penalties and logit_bias: greedy tokens equal a
    transformers loop that applies them by hand."""
    from test_penalties import penalised_greedy

    hf = load_hf_model(model_path, dtype=torch.float32)
    tok = oracle.tok
    ids = oracle.chat_ids(MESSAGES)
    plain, _ = oracle(ids)
    openai_params = dict(frequency_penalty=0.8, presence_penalty=0.4, logit_bias={str(plain[0]): -100.0})
    params = dict(openai_params, repetition_penalty=1.4)
    expected = penalised_greedy(hf, ids, MAX_NEW, **params)
    assert expected != plain
    text = tok.decode(expected, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    extra = {"repetition_penalty": 1.4, "ignore_eos": True}
    r = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=MAX_NEW,
        temperature=0,
        extra_body=extra,
        **openai_params,
    )
    assert r.choices[0].message.content == text
    r = client.completions.create(
        model=model_name, prompt=ids, max_tokens=MAX_NEW, temperature=0, extra_body=extra, **openai_params
    )
    assert r.choices[0].text == text
    sampling = dict(params, max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    r = post(server, "/generate", {"input_ids": ids, "sampling_params": sampling})
    assert r.status_code == 200 and r.json()["output_ids"] == expected


def test_unknown_route_and_the_server_still_answers(server, client, model_name):
    r = get(server, "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=2)
    assert r.usage.completion_tokens <= 2
    assert_idle_accounting(server)


def test_metrics_off_by_default_and_device_auto(server):
    """As SGLang: no --enable-metrics, no /metrics (a 404 that says why; the metrics themselves are
    checked in test_observability.py). No --device: auto."""
    r = get(server, "/metrics")
    assert r.status_code == 404 and "--enable-metrics" in r.json()["error"]["message"]
    info = get(server, "/get_server_info").json()
    assert info["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert isinstance(info["random_seed"], int)


def test_server_info_models_and_flush(server, model_name):
    info = get(server, "/get_server_info").json()
    assert info["model_path"] and info["max_total_tokens"] == 16384 and "num_prefill_tokens" in info
    assert info["disable_shared_prefix_attention"] is False  # the switch, on by default
    assert info["shared_prefix_attention_min_len"] == 64
    # What the worker resolved at load, and why: random float32 weights stay on torch's linears.
    assert (info["resolved_dtype"], info["resolved_dtype_reason"]) == ("float32", "--dtype float32")
    assert info["resolved_kv_cache_dtype"] == "float32"
    assert info["linear_kernel"] == "torch" and info["linear_kernel_reason"]
    assert get(server, "/v1/models").json()["data"][0]["id"] == model_name
    assert post(server, "/flush_cache").status_code == 200
    assert get(server, "/get_server_info").json()["evictable_tokens"] == 0


def test_sigterm_shuts_down_without_orphans(server):
    kids = {p.pid for p in psutil.Process(server.pid).children(recursive=True)}
    assert kids
    server.send_signal(signal.SIGTERM)
    assert server.wait(30) == 0
    assert wait_gone(kids) == set()
