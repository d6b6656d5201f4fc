"""Scale-out: two radixengine replicas behind SGLang's router (`sglang-router` 0.3.2, its Rust
binary, cache_aware policy) on loopback, all real processes and HTTP.

What the cache-aware policy promises (sgl-model-gateway/src/policies/cache_aware.rs at the 0.3.2
release): while the workers' in-flight loads are balanced (difference <= balance_abs_threshold or
ratio <= balance_rel_threshold), a request whose text matches more than `cache_threshold` of its
characters in the router's approximate radix tree (request texts it routed, per worker) goes to the
worker with the longest match; otherwise to the least-loaded worker. So with requests sent one at
a time, a tenant's later requests (a long shared system prompt) follow its first one to the same
replica, and hit that replica's radix cache. It does not promise that two tenants land on
different replicas (a new prefix goes to the least-loaded worker, ties to the first), so that is
not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest
from test_engine_utils import (
    build_tiny_model,
    start_test_server,
    stop_test_server,
    wait_gone,
    wait_test_server,
)

try:
    from sglang_router import sglang_router_rs  # noqa: F401  (the Rust router binary)
except ImportError as e:
    pytest.skip(
        f"sglang-router is not installed ({e}); `pip install sglang-router==0.3.2` (in the test extras)",
        allow_module_level=True,
    )

from radixengine.utils.network import get_free_port  # noqa: E402

API_KEY = "sk-router-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SERVED_NAME = "tiny-llama"
MAX_NEW = 8
TIMEOUT = 120.0
# Two tenants: long system prompts that differ from their first character on.
SYSTEM = {
    "A": "Alpha support desk. " + "You answer questions about the quick brown fox and the lazy dog. " * 8,
    "B": "Bravo travel agent. " + "Once upon a time there was a small model that answered with numbers. " * 8,
}
QUESTIONS = ["hello world", "this is a test", "hello world this is a test of the engine"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_llama")), max_position_embeddings=1024)


REPLICA_ARGS = [
    "--dtype", "float32", "--max-total-tokens", "16384", "--num-threads", "1",
    "--served-model-name", SERVED_NAME, "--api-key", API_KEY,
]  # fmt: skip


@pytest.fixture(scope="module")
def cluster(model_path, tmp_path_factory):
    """Two replicas and the router in front of them; yields (router process, replica processes),
    each with `base_url` and `log`."""
    logs = tmp_path_factory.mktemp("cluster")
    replicas = [start_test_server(model_path, logs / f"replica{i}.log", REPLICA_ARGS) for i in range(2)]
    router = None
    try:
        for r in replicas:
            wait_test_server(r)
        router = start_router([r.base_url for r in replicas], logs / "router.log")
        wait_until(lambda: healthy_workers(router) == {r.base_url for r in replicas}, router.log)
        yield router, replicas
    finally:
        for proc in [*replicas, router]:
            if proc is not None:
                stop_test_server(proc)


def start_router(worker_urls: list[str], log_path) -> subprocess.Popen:
    port = get_free_port()
    cmd = [
        sys.executable, "-m", "sglang_router.launch_router",
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(get_free_port()),
        "--worker-urls", *worker_urls,
        "--policy", "cache_aware", "--api-key", API_KEY,
        "--health-check-interval-secs", "1", "--health-check-timeout-secs", "2",
        "--health-failure-threshold", "2", "--health-success-threshold", "1",
        "--disable-circuit-breaker", "--log-level", "warn",
    ]  # fmt: skip
    with open(log_path, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    proc.base_url, proc.log = f"http://127.0.0.1:{port}", log_path
    return proc


def wait_until(condition, log_path, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out; log:\n{log_path.read_text()[-4000:]}"
        time.sleep(0.2)


def healthy_workers(router) -> set[str]:
    """The worker URLs the router has registered and considers healthy (its GET /workers)."""
    assert router.poll() is None, router.log.read_text()
    try:
        workers = httpx.get(router.base_url + "/workers", headers=AUTH, timeout=5).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return set()
    return {w["url"] for w in workers if w["is_healthy"]}


def post(base_url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base_url + path, json=body, headers=AUTH, timeout=TIMEOUT)


def openai_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT)


def chat(base_url: str, messages: list[dict], stream: bool = False, **kw) -> tuple[str, int]:
    """The greedy answer's text and its completion-token count, through the official client."""
    client = openai_client(base_url)
    args = dict(model=SERVED_NAME, messages=messages, max_tokens=MAX_NEW, temperature=0, **kw)
    if not stream:
        out = client.chat.completions.create(**args)
        return out.choices[0].message.content, out.usage.completion_tokens
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage.completion_tokens


def completion(base_url: str, stream: bool) -> tuple[str, int]:
    client = openai_client(base_url)
    args = dict(model=SERVED_NAME, prompt="hello world this is", max_tokens=MAX_NEW, temperature=0)
    if not stream:
        out = client.completions.create(**args)
        return out.choices[0].text, out.usage.completion_tokens
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks[-1].usage.completion_tokens


def generate(base_url: str, stream: bool) -> tuple[str, list[int]]:
    body = {
        "text": "once upon a time",
        "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0},
        "stream": stream,
    }
    if not stream:
        resp = post(base_url, "/generate", body)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        return out["text"], out["output_ids"]
    with httpx.stream("POST", base_url + "/generate", json=body, headers=AUTH, timeout=TIMEOUT) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    last = json.loads(lines[-2])
    return last["text"], last["output_ids"]


CALLS = {
    "chat": lambda url: chat(url, [{"role": "user", "content": "hello world"}]),
    "chat_stream": lambda url: chat(url, [{"role": "user", "content": "hello world"}], stream=True),
    "completion": lambda url: completion(url, stream=False),
    "completion_stream": lambda url: completion(url, stream=True),
    "generate": lambda url: generate(url, stream=False),
    "generate_stream": lambda url: generate(url, stream=True),
}


@pytest.mark.parametrize("kind", list(CALLS))
def test_same_greedy_tokens_through_the_router(cluster, kind):
    router, replicas = cluster
    direct = CALLS[kind](replicas[0].base_url)
    assert direct[1], direct  # something was generated
    assert CALLS[kind](router.base_url) == direct


def test_router_models_names_the_served_model(cluster):
    router, replicas = cluster
    ids = [m["id"] for m in httpx.get(router.base_url + "/v1/models", timeout=10).json()["data"]]
    assert ids == [SERVED_NAME]
    assert [m.id for m in openai_client(replicas[1].base_url).models.list().data] == [SERVED_NAME]


def test_router_reads_the_replicas_info_and_load(cluster):
    """What the router read at registration (/server_info, /model_info) and reads for load
    (/get_load: a list with `num_tokens`; -1 when it cannot)."""
    router, replicas = cluster
    workers = httpx.get(router.base_url + "/workers", headers=AUTH, timeout=10).json()["workers"]
    assert {w["url"] for w in workers} == {r.base_url for r in replicas}
    for w in workers:
        assert w["model_id"] == SERVED_NAME
        assert w["metadata"]["served_model_name"] == SERVED_NAME and w["metadata"]["model_type"] == "llama"
    loads = httpx.get(router.base_url + "/get_loads", headers=AUTH, timeout=10).json()["workers"]
    assert {w["worker"] for w in loads} == {r.base_url for r in replicas}
    assert all(w["load"] >= 0 for w in loads), loads


def counters(replica) -> tuple[int, int]:
    """(prompt tokens seen, prompt tokens served from the radix cache) since the replica started."""
    info = httpx.get(replica.base_url + "/get_server_info", headers=AUTH, timeout=10).json()
    return info["num_prefill_tokens"] + info["num_cached_tokens"], info["num_cached_tokens"]


def tenant_chat(router, replicas, tenant: str, question: str) -> tuple[int, int, str]:
    """One tenant request through the router: (index of the replica that served it, the tokens it
    read from that replica's cache, the answer)."""
    before = [counters(r) for r in replicas]
    messages = [{"role": "system", "content": SYSTEM[tenant]}, {"role": "user", "content": question}]
    out = openai_client(router.base_url).chat.completions.create(
        model=SERVED_NAME, messages=messages, max_tokens=MAX_NEW, temperature=0
    )
    after = [counters(r) for r in replicas]
    # The replica whose prompt tokens grew by this prompt (robust to a probe's few tokens).
    served = [i for i in range(len(replicas)) if after[i][0] - before[i][0] >= out.usage.prompt_tokens]
    assert len(served) == 1, (before, after, out.usage)
    return served[0], after[served[0]][1] - before[served[0]][1], out.choices[0].message.content


def system_prefix_len(model_path: str, tenant: str) -> int:
    """Tokens of the chat-templated system turn: the prefix every request of the tenant shares."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    text = tok.apply_chat_template([{"role": "system", "content": SYSTEM[tenant]}], tokenize=False)
    return len(tok.encode(text, add_special_tokens=False))


def test_each_tenant_sticks_to_one_replica_and_hits_its_cache(cluster, model_path):
    router, replicas = cluster
    shared = {t: system_prefix_len(model_path, t) for t in SYSTEM}
    assert min(shared.values()) > 100
    served: dict[str, list[int]] = {t: [] for t in SYSTEM}
    cached: dict[str, list[int]] = {t: [] for t in SYSTEM}
    for question in QUESTIONS:
        for tenant in SYSTEM:
            replica, hit, _ = tenant_chat(router, replicas, tenant, question)
            served[tenant].append(replica)
            cached[tenant].append(hit)
    for tenant in SYSTEM:
        assert len(set(served[tenant])) == 1, served
        assert cached[tenant][0] < shared[tenant], cached  # the first one computed its prompt
        assert all(hit >= shared[tenant] for hit in cached[tenant][1:]), (cached, shared)


USER = [{"role": "user", "content": "hello world"}]
CHAT, COMPLETIONS, GENERATE = "/v1/chat/completions", "/v1/completions", "/generate"
# Bodies as clients send them (any model name, nulls, SGLang's extra fields, content parts).
CLIENT_BODIES = [
    (CHAT, {"model": "default", "messages": USER, "max_tokens": 4, "temperature": 0}),
    (CHAT, {
        "model": SERVED_NAME, "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        "max_tokens": 4, "temperature": 0, "top_p": None, "top_k": None, "n": None, "stop": None, "seed": None,
        "presence_penalty": None, "frequency_penalty": None, "user": "u-1", "stream": False,
    }),
    (CHAT, {
        "model": "anything", "messages": USER, "max_completion_tokens": 4, "temperature": 0,
        "stop": ["\n\n"], "n": 2, "top_k": 1, "min_p": 0.0, "ignore_eos": True, "skip_special_tokens": True,
    }),
    (COMPLETIONS, {"model": "default", "prompt": ["hello", "world"], "max_tokens": 4, "temperature": 0}),
    (COMPLETIONS, {"model": SERVED_NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0,
                   "stop": None, "logprobs": None, "suffix": None, "echo": False}),
    (GENERATE, {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}),
    (GENERATE, {"text": "hello", "rid": "client-rid-1", "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "stop": ["\n"], "ignore_eos": False, "n": 2}}),
]  # fmt: skip
LONG_PROMPT = "hello world " * 700  # past the 1024-token context
BAD_BODIES = [
    (CHAT, {"model": SERVED_NAME, "messages": USER, "max_tokens": -1}),
    (CHAT, {"model": SERVED_NAME, "messages": USER, "max_tokens": 4, "top_k": 0}),
    (COMPLETIONS, {"model": SERVED_NAME, "prompt": LONG_PROMPT, "max_tokens": 4}),
    (GENERATE, {"text": LONG_PROMPT, "sampling_params": {"max_new_tokens": 4}}),
    (GENERATE, {"text": "hello", "sampling_params": {"max_new_tokens": 4, "temperature": -1}}),
]
# Accepted by a replica, refused by sglang-router 0.3.2 itself (its typed request parsing and
# validation) before any replica sees them; listed in the README.
ROUTER_REFUSES = [
    (CHAT, {"model": SERVED_NAME, "messages": USER, "max_tokens": 4, "temperature": 2.5}),
    (CHAT, {"model": SERVED_NAME, "messages": USER, "max_tokens": 4, "n": 11}),
    (CHAT, {"model": SERVED_NAME, "messages": USER, "max_tokens": 4, "stop": ["a", "b", "c", "d", "e"]}),
    (CHAT, {"model": SERVED_NAME, "messages": USER, "max_tokens": 4, "min_tokens": 0}),
    (
        CHAT,
        {"model": SERVED_NAME, "messages": USER, "max_tokens": 4, "stream_options": {"include_usage": True}},
    ),
    (COMPLETIONS, {"model": SERVED_NAME, "prompt": [5, 6, 7], "max_tokens": 4}),
    (GENERATE, {"text": ["hello", "world"], "sampling_params": {"max_new_tokens": 4}}),
    (GENERATE, {"text": "hello", "sampling_params": [{"max_new_tokens": 4}]}),
]


@pytest.mark.parametrize(
    "path,body", CLIENT_BODIES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CLIENT_BODIES)]
)
def test_client_bodies_work_through_the_router(cluster, path, body):
    router, replicas = cluster
    direct, routed = post(replicas[0].base_url, path, body), post(router.base_url, path, body)
    assert direct.status_code == 200, direct.text
    assert routed.status_code == 200, routed.text
    assert answers(routed.json()) == answers(direct.json())


def test_bad_values_get_the_replicas_400_through_the_router(cluster):
    """The replica's own 400 (message, field) comes through unchanged, and many in a row do not
    take the replicas out (the router runs with --disable-circuit-breaker: its breaker counts a
    client's 400 as a worker failure)."""
    router, replicas = cluster
    for path, body in BAD_BODIES:
        direct, routed = post(replicas[0].base_url, path, body), post(router.base_url, path, body)
        assert direct.status_code == 400, direct.text
        assert 400 <= routed.status_code < 500, routed.text
    path, body = BAD_BODIES[2]
    for _ in range(25):
        routed = post(router.base_url, path, body)
        assert routed.status_code == 400 and routed.json()["error"]["param"] == "prompt", routed.text
    assert post(router.base_url, *CLIENT_BODIES[0]).status_code == 200
    assert healthy_workers(router) == {r.base_url for r in replicas}


def test_what_the_router_itself_refuses(cluster):
    """The only 4xx through the router that a direct request does not get: the router's own
    refusals (its error shapes, no replica involved)."""
    router, replicas = cluster
    for path, body in ROUTER_REFUSES:
        direct, routed = post(replicas[0].base_url, path, body), post(router.base_url, path, body)
        assert direct.status_code == 200, (path, body, direct.text)
        assert routed.status_code in (400, 422), (path, body, routed.text)
        router_own = routed.status_code == 422 or routed.json()["error"]["type"] == "invalid_request_error"
        assert router_own, (path, body, routed.text)


def answers(out) -> list:
    """The generated part of an OpenAI or /generate answer (no ids or timings)."""
    if isinstance(out, list):
        return [answers(o) for o in out]
    if "choices" in out:
        return [(c.get("message") or {}).get("content", c.get("text")) for c in out["choices"]]
    return [out["text"], out["output_ids"]]


def test_a_dead_replica_is_taken_out_and_the_rest_keep_serving(cluster, model_path):
    """Kills the replica tenant A's requests go to (a crash: SIGKILL); the router's health check
    takes it out, tenant A moves to the survivor and hits the cache there from its second request
    on; a replica started again on the same address is taken back in."""
    router, replicas = cluster
    victim, _, answer = tenant_chat(router, replicas, "A", QUESTIONS[0])
    dead = replicas[victim]
    kids = {p.pid for p in psutil.Process(dead.pid).children(recursive=True)}
    dead.kill()
    dead.wait()
    assert wait_gone(kids, timeout=30) == set()
    survivor = replicas[1 - victim]
    wait_until(lambda: healthy_workers(router) == {survivor.base_url}, router.log)

    alive = [survivor]
    first = tenant_chat(router, alive, "A", QUESTIONS[0])
    assert first[2] == answer  # the same greedy answer from the other replica
    shared = system_prefix_len(model_path, "A")
    for question in QUESTIONS[1:]:
        _, hit, _ = tenant_chat(router, alive, "A", question)
        assert hit >= shared
    for kind in ("chat_stream", "completion", "generate"):
        assert CALLS[kind](router.base_url) == CALLS[kind](survivor.base_url)

    restarted = start_test_server(
        model_path, dead.log.with_suffix(".restart.log"), REPLICA_ARGS, port=dead.port
    )
    replicas[victim] = restarted  # the fixture stops it
    wait_test_server(restarted)
    wait_until(lambda: healthy_workers(router) == {r.base_url for r in replicas}, router.log)
    assert CALLS["chat"](router.base_url) == CALLS["chat"](restarted.base_url)
