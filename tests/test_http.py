"""The HTTP server, started for real (`python -m radixengine.launch_server`) on a free loopback port
with a tiny random Llama: the official openai client (chat and completions, streaming and not,
stop sequences, n=2, logprobs), 64 concurrent streams, a client that disconnects, bad input,
/metrics, the API key, and a clean SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from test_engine_utils import build_tiny_model, hf_greedy, load_hf_model, subprocess_env, wait_gone

from radixengine.utils.network import get_free_port

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_NEW = 10
CONTEXT = 1024


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_llama")), max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    port = get_free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [
        sys.executable, "-m", "radixengine.launch_server", "--model-path", model_path, "--port", str(port),
        "--dtype", "float32", "--max-total-tokens", "16384", "--num-threads", "1", "--api-key", API_KEY,
    ]  # fmt: skip
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=subprocess_env())
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited:\n{log.read_text()}"
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.base_url, proc.log = base, log
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


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
    deadline = time.monotonic() + timeout
    while True:
        info = get(server, "/get_server_info").json()
        idle = info["num_running_reqs"] == 0 and info["num_queue_reqs"] == 0
        total = info["available_tokens"] + info["evictable_tokens"] + info["protected_tokens"]
        if idle and total == info["max_total_tokens"]:
            return info
        assert time.monotonic() < deadline, f"not idle or tokens leaked: {info}"
        time.sleep(0.2)


MESSAGES = [{"role": "user", "content": "hello world this is a test"}]


def test_ready_line_health_and_api_key(server):
    # The ready line is logged once the server answered its own warm-up request; give it time.
    deadline = time.monotonic() + 30
    while "ready to roll" not in server.log.read_text():
        assert time.monotonic() < deadline, server.log.read_text()
        time.sleep(0.2)
    assert httpx.get(server.base_url + "/health").status_code == 200
    for path in ("/v1/models", "/get_server_info", "/metrics", "/health_generate"):
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
        model=model_name, messages=MESSAGES, max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True}
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
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_NEW, temperature=0, stop=[stop])
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
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert all(tokens == 8 for _, tokens in results)
    assert all(n_chunks >= 2 for n_chunks, _ in results)
    assert_idle_accounting(server)


def test_disconnect_mid_stream_aborts_and_frees(server):
    body = {"text": "a long one", "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}, "stream": True}
    before = get(server, "/get_server_info").json()["num_generated_tokens"]
    with httpx.stream("POST", server.base_url + "/generate", headers=AUTH, json=body, timeout=60) as resp:
        got = []
        for line in resp.iter_lines():
            if line.startswith("data: "):
                got.append(line)
            if len(got) >= 3:
                break
    info = assert_idle_accounting(server)
    assert info["num_generated_tokens"] - before < 900, "the request ran to the end instead of being aborted"
    # A non-streaming client that gives up is aborted too.
    before = info["num_generated_tokens"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/generate", headers=AUTH, json={**body, "stream": False}, timeout=1.0)
    info = assert_idle_accounting(server)
    assert info["num_generated_tokens"] - before < 900, "the request ran to the end instead of being aborted"


BAD_INPUTS = [
    ("/v1/chat/completions", b'{"model": ', "body"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": MESSAGES, "max_tokens": "5"}, "max_tokens"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": MESSAGES, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"model": "no-such-model", "messages": MESSAGES}, "model"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": MESSAGES, "max_tokens": -3}, "max_tokens"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": MESSAGES, "max_tokens": CONTEXT}, "max_tokens"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": MESSAGES, "temperature": -0.5}, "temperature"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": MESSAGES, "frequency_penalty": 0.5}, "frequency_penalty"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": MESSAGES, "bogus": 1}, "bogus"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": MESSAGES, "stream": True, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": "MODEL", "prompt": "hello " * 3000}, "prompt"),
    ("/v1/completions", {"model": "MODEL", "prompt": [5] * CONTEXT, "stream": True}, "prompt"),
    ("/v1/completions", {"model": "MODEL", "prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"model": "MODEL", "prompt": 5}, "prompt"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokenz": 3}}, "max_new_tokenz"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
    ("/generate", {"input_ids": [10**7]}, "input_ids"),
    ("/generate", {"text": "hi", "priority": "high"}, "priority"),
]


@pytest.mark.parametrize("route,body,param", BAD_INPUTS, ids=[f"{r}:{p}" for r, _, p in BAD_INPUTS])
def test_bad_input_gets_400_naming_the_field(server, model_name, route, body, param):
    if isinstance(body, bytes):
        r = post(server, route, content=body)
    else:
        r = post(server, route, json.loads(json.dumps(body).replace('"MODEL"', json.dumps(model_name))))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["code"] == 400 and err["type"]


def test_unknown_route_and_the_server_still_answers(server, client, model_name):
    r = get(server, "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=2)
    assert r.usage.completion_tokens <= 2
    assert_idle_accounting(server)


def _metrics(server) -> dict[str, float]:
    text = get(server, "/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def test_metrics_parse_and_move(server, client, model_name):
    before = _metrics(server)
    client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=5, extra_body={"ignore_eos": True}, stream=False
    )
    after = _metrics(server)
    p = "radixengine:"
    assert after[p + "generation_tokens_total"] - before.get(p + "generation_tokens_total", 0) == 5
    assert after[p + "num_requests_total"] == before.get(p + "num_requests_total", 0) + 1
    assert after[p + "prompt_tokens_total"] > before.get(p + "prompt_tokens_total", 0)
    assert after[p + "time_to_first_token_seconds_count"] > before.get(p + "time_to_first_token_seconds_count", 0)
    assert after[p + "e2e_request_latency_seconds_count"] > before.get(p + "e2e_request_latency_seconds_count", 0)
    for name in ("num_running_reqs", "num_queue_reqs", "token_usage", "cache_hit_rate", "num_retracted_reqs_total",
                 "num_preempted_reqs_total", "inter_token_latency_seconds_count"):  # fmt: skip
        assert p + name in after, name


def test_server_info_models_and_flush(server, model_name):
    info = get(server, "/get_server_info").json()
    assert info["model_path"] and info["max_total_tokens"] == 16384 and "num_prefill_tokens" in info
    assert get(server, "/v1/models").json()["data"][0]["id"] == model_name
    assert post(server, "/flush_cache").status_code == 200
    assert get(server, "/get_server_info").json()["evictable_tokens"] == 0


def test_sigterm_shuts_down_without_orphans(server):
    kids = {p.pid for p in psutil.Process(server.pid).children(recursive=True)}
    assert kids
    server.send_signal(signal.SIGTERM)
    assert server.wait(30) == 0
    assert wait_gone(kids) == set()
