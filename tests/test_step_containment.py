"""A step that raises ends the requests of that step, not the server: through the real server and
the official `openai` client, for each phase a fault is injected in (RADIXENGINE_TEST_FAULT).

With --max-running-requests 1 each step holds one request, so a fault fails exactly one of three
concurrent requests: a 500 naming the failure (an error event when it streams and had begun).
(A fault in the overlap loop's stale batch, whose request finished a step earlier, ends none.)
The other two finish with the tokens the same prompts get afterwards, new requests succeed, and
no KV slot is leaked. The five phases every step runs share one server (their faults 25 steps
apart: waves of three requests run until each has fired); the grammar's, the drafter's and
the cache load's need servers of their own."""

from __future__ import annotations

import json
import os
import threading

import openai
import pytest
from test_engine_utils import launch_test_server, stop_test_server
from test_http import API_KEY, assert_idle_accounting, model_path  # noqa: F401

from radixengine.utils.fault_injection import ENV

STEP_PHASES = ("schedule", "prepare", "forward", "sample", "process")
SERVERS = {  # name: (flags, RADIXENGINE_TEST_FAULT)
    "step": ([], ",".join(f"{phase}:{3 + 25 * i}" for i, phase in enumerate(STEP_PHASES))),
    "grammar": ([], "grammar:2"),
    "drafter": (["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4"], "drafter:3"),
    "cache_load": (["--enable-hierarchical-cache", "--hicache-storage-backend", "file"], "cache_load:1"),
}
PROMPTS = ["one two three one two three", "the cat sat on the mat", "red green blue red green"]
MAX_TOKENS = 8
MAX_WAVES = 20


@pytest.fixture(scope="module", params=list(SERVERS))
def server(request, model_path, tmp_path_factory):  # noqa: F811
    name = request.param
    flags, faults = SERVERS[name]
    log = tmp_path_factory.mktemp(f"server-{name}") / "server.log"
    args = ["--dtype", "float32", "--max-total-tokens", "4096", "--num-threads", "1", "--api-key", API_KEY]
    args += ["--max-running-requests", "1", *flags]
    if name == "cache_load":
        args += ["--hicache-storage-dir", str(log.parent / "kv")]
    os.environ[ENV] = faults
    try:
        proc = launch_test_server(model_path, log, args)
    finally:
        del os.environ[ENV]
    proc.phases = STEP_PHASES if name == "step" else (name,)
    yield proc
    stop_test_server(proc)


def ask(client: openai.OpenAI, prompt: str, stream: bool, grammar: bool) -> tuple[str, str]:
    """("ok", text) or ("error", message) of one chat completion."""
    kw = dict(
        model="m",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    if grammar:
        kw["response_format"] = {"type": "json_object"}
    try:
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            return "ok", "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return "ok", client.chat.completions.create(**kw).choices[0].message.content
    except openai.InternalServerError as e:
        return "error", f"500 {e.message}"
    except openai.APIError as e:  # an error event in a stream
        assert stream, e
        return "error", f"stream {e.message}"


def wave(client: openai.OpenAI, shapes: list[tuple[bool, bool]]) -> dict[int, tuple[str, str]]:
    """The three prompts at once."""
    outcomes: dict[int, tuple[str, str]] = {}

    def run(i: int) -> None:
        outcomes[i] = ask(client, PROMPTS[i], *shapes[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(outcomes) == 3, outcomes
    return outcomes


def fired(server) -> set[str]:
    """The phases whose fault fired, from the server's log."""
    log = server.log.read_text()
    return {phase for phase in server.phases if f"injected fault in the {phase} phase" in log}


def test_a_failing_step_ends_its_requests_and_the_server_goes_on(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    grammar = server.phases == ("grammar",)  # only the first request has one: it is the one that fails
    shapes = [(True, grammar), (False, False), (False, False)]  # (stream, grammar)
    waves = []
    while fired(server) != set(server.phases):
        assert len(waves) < MAX_WAVES, fired(server)
        waves.append(wave(client, shapes))
    failures = [(i, message) for w in waves for i, (kind, message) in w.items() if kind == "error"]
    for i, message in failures:
        assert any(f"InjectedFault: injected fault in the {p} phase" in message for p in server.phases), (
            message
        )
        # A stream that failed before its first token is answered a plain 500, later an error event.
        assert message.startswith(("500", "stream") if shapes[i][0] else "500"), message
    # Each fault ended the one request of its step (none: the overlap loop's stale batch, whose
    # request had finished), and the clients saw exactly those.
    log = server.log.read_text()
    ended = log.count("a step failed; ending its 1 requests")
    assert ended + log.count("a step failed; ending its 0 requests") == len(server.phases), log
    assert len(failures) == ended >= 1, failures
    if grammar:
        assert failures[0][0] == 0
    # The same prompts again (new requests, no fault left): the survivors' tokens were these.
    again = {i: ask(client, PROMPTS[i], *shapes[i]) for i in range(3)}
    assert all(kind == "ok" for kind, _ in again.values()), again
    for w in waves:
        for i, outcome in w.items():
            assert outcome[0] == "error" or outcome == again[i], (i, outcome, again[i])
    info = assert_idle_accounting(server)
    assert info["available_tokens"] + info["evictable_tokens"] == info["max_total_tokens"]
    assert info["scheduler_restarts"] == 0


def test_a_failing_step_is_an_error_line_of_its_batch(model_path, tmp_path):  # noqa: F811
    """One line at a time: the line whose step fails is a 500 line of the error file naming the
    failure; the batch completes with every other line answered once."""
    from test_batches_api import chat_line, jsonl, wait_batch

    args = ["--dtype", "float32", "--max-total-tokens", "4096", "--num-threads", "1", "--max-running-requests",
            "1", "--batch-dir", str(tmp_path / "batch_dir"), "--batch-max-running", "1"]  # fmt: skip
    os.environ[ENV] = "process:2"
    try:
        server = launch_test_server(model_path, tmp_path / "server.log", args)
    finally:
        del os.environ[ENV]
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
        lines = [chat_line(f"line{i}", max_tokens=4) for i in range(4)]
        upload = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")  # fmt: skip
        done = wait_batch(client, batch.id, timeout=120)
        assert done.status == "completed", done
        assert (done.request_counts.completed, done.request_counts.failed) == (3, 1)
        errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
        out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        assert [e["custom_id"] for e in errors] == ["line0"]
        response = errors[0]["response"]
        assert response["status_code"] == 500
        assert "InjectedFault: injected fault in the process phase" in response["body"]["error"]["message"]
        assert sorted(o["custom_id"] for o in out) == ["line1", "line2", "line3"]
    finally:
        stop_test_server(server)
