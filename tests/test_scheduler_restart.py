"""A dead scheduler is started again, through the real server: SIGKILL of the scheduler process
while 16 requests stream ends each of them with an error (none hangs), /health is 503 while a new
scheduler starts and 200 again within 30 s, the next request succeeds, the restart is counted in
/get_server_info and /metrics, and a /v1/batches batch running at the time completes with every
line answered exactly once. A crash loop (a scheduler that dies at its first forward, every time)
ends in the server's exit code 1 once --max-scheduler-restarts is spent. Under --tp-size 2 a killed
rank restarts with its rank 0."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from test_batches_api import chat_line, jsonl, wait_batch
from test_engine_utils import build_tiny_model, launch_test_server, stop_test_server, wait_gone

from radixengine.utils.fault_injection import ENV

STREAMS = 16
BATCH_LINES = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("restart") / "model"), max_position_embeddings=8192)


def server_args(root) -> list[str]:
    return ["--dtype", "float32", "--num-threads", "1", "--max-total-tokens", "65536", "--max-running-requests", "32", "--enable-metrics",
            "--batch-dir", str(root / "batch_dir"), "--batch-max-running", "2"]  # fmt: skip


def stream_until_error(client: openai.OpenAI, started: threading.Event, outcome: list) -> None:
    kw = dict(model="m", messages=[{"role": "user", "content": "count with me"}], max_tokens=3000,
              temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    try:
        for _ in client.chat.completions.create(stream=True, **kw):
            started.set()
        outcome.append("finished")
    except openai.APIError as e:
        outcome.append(e.message)


def wait_health(base_url: str, status: int, timeout: float) -> float:
    """Seconds until /health answers `status`."""
    start = time.monotonic()
    while httpx.get(base_url + "/health", timeout=5).status_code != status:
        assert time.monotonic() - start < timeout, f"/health did not answer {status} within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - start


def test_a_killed_scheduler_is_restarted_and_its_batch_completes(model, tmp_path):
    server = launch_test_server(model, tmp_path / "server.log", server_args(tmp_path))
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    try:
        # Long enough (3 rounds of 1,500 steps at --batch-max-running 2) to be running still once
        # the 16 streams have started, however slowly the machine starts them.
        lines = [chat_line(f"line{i}", max_tokens=1500) for i in range(BATCH_LINES)]
        upload = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")  # fmt: skip
        events = [threading.Event() for _ in range(STREAMS)]
        outcomes: list[list] = [[] for _ in range(STREAMS)]
        threads = [
            threading.Thread(target=stream_until_error, args=(client, events[i], outcomes[i]), daemon=True)
            for i in range(STREAMS)
        ]
        for t in threads:
            t.start()
        for e in events:
            assert e.wait(120), "a stream did not start"
        info = httpx.get(server.base_url + "/get_server_info", timeout=30).json()
        assert info["scheduler_restarts"] == 0
        assert client.batches.retrieve(batch.id).status == "in_progress"

        os.kill(info["scheduler_pid"], signal.SIGKILL)
        wait_health(server.base_url, 503, 10)
        assert wait_health(server.base_url, 200, 30) < 30
        for t in threads:
            t.join(30)
            assert not t.is_alive(), "a stream hangs"
        for outcome in outcomes:
            assert len(outcome) == 1 and "died unexpectedly" in outcome[0], outcome

        answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, temperature=0)  # fmt: skip
        assert answer.choices[0].message.content is not None
        info = httpx.get(server.base_url + "/get_server_info", timeout=30).json()
        assert info["scheduler_restarts"] == 1
        metrics = httpx.get(server.base_url + "/metrics", timeout=30).text
        assert "sglang:scheduler_restarts_total" in metrics and "} 1.0" in _line(metrics, "restarts_total")

        done = wait_batch(client, batch.id, timeout=300)
        assert done.status == "completed" and done.request_counts.completed == BATCH_LINES
        out = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
        assert sorted(line["custom_id"] for line in out) == sorted(line["custom_id"] for line in lines)
        assert all(line["response"]["status_code"] == 200 for line in out)
        assert done.error_file_id is None
        assert "the scheduler restarted; running it again" in server.log.read_text()
    finally:
        stop_test_server(server)


def _line(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if name in line and not line.startswith("#"))


def test_a_crash_loop_ends_in_a_non_zero_exit(model, tmp_path):
    os.environ[ENV] = "forward:1:SIGKILL"  # every new scheduler dies at its first forward
    try:
        server = launch_test_server(
            model, tmp_path / "server.log", [*server_args(tmp_path), "--max-scheduler-restarts", "2"]
        )
    finally:
        del os.environ[ENV]
    try:
        deadline = time.monotonic() + 300
        while server.poll() is None:
            assert time.monotonic() < deadline, "the server did not give up"
            try:
                httpx.post(server.base_url + "/generate", json={"text": "hi"}, timeout=30)
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        log = server.log.read_text()
        assert server.returncode == 1, log
        assert log.count("failing its requests and starting a new scheduler") == 2, log
        assert "not restarted: 2 restarts within 600 s" in log, log
    finally:
        stop_test_server(server)


def test_tp_ranks_restart_together(model, tmp_path):
    """--tp-size 2: a killed rank 1 ends rank 0; both start again and serve."""
    import psutil

    args = ["--dtype", "float32", "--num-threads", "1", "--max-total-tokens", "4096", "--tp-size", "2"]
    server = launch_test_server(model, tmp_path / "server.log", args)
    try:
        pid = httpx.get(server.base_url + "/get_server_info", timeout=30).json()["scheduler_pid"]
        (rank1,) = [p for p in psutil.Process(pid).children() if "scheduler_ranks" in " ".join(p.cmdline())]
        os.kill(rank1.pid, signal.SIGKILL)
        wait_health(server.base_url, 503, 10)
        wait_health(server.base_url, 200, 120)
        assert wait_gone({pid, rank1.pid}) == set()
        info = httpx.get(server.base_url + "/get_server_info", timeout=30).json()
        assert info["scheduler_restarts"] == 1 and info["scheduler_pid"] != pid
        ranks = [
            p
            for p in psutil.Process(info["scheduler_pid"]).children()
            if "scheduler_ranks" in " ".join(p.cmdline())
        ]
        assert len(ranks) == 1
        r = httpx.post(server.base_url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4}},
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        assert "TP rank 1 died" in server.log.read_text()
    finally:
        stop_test_server(server)
