"""Observability and flags as SGLang has them, against a real server (`python -m
radixengine.launch_server`, a tiny random Llama): /metrics with SGLang's metric names and labels
(what its Grafana dashboard queries), the `Prefill batch` / `Decode batch` log lines,
`--log-requests`, help text on every flag, `--device auto`, `--random-seed`, a flag choice this
machine cannot run refused at start, and `--watchdog-timeout` ending a forward that hangs."""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from test_engine_utils import (
    build_tiny_model,
    children_paused,
    launch_test_server,
    raw_post,
    read_until,
    stop_test_server,
    subprocess_env,
    wait_until,
)

from radixengine.launch_server import parse_args
from radixengine.managers.io_struct import GenerateReqInput
from radixengine.managers.request_logger import RequestLogger
from radixengine.model_executor.runtime_support import runtime_support_error
from radixengine.model_executor.tp_worker import TEST_FORWARD_STALL_ENV
from radixengine.server_args import ServerArgs
from radixengine.utils.network import get_free_port
from radixengine.utils.random_seed import set_random_seed

# The series SGLang's Grafana dashboard queries, from
# examples/monitoring/grafana/dashboards/json/sglang-dashboard.json in SGLang's repository (its
# `expr` fields). The dashboard writes them `sglang_<name>` since SGLang PR #15758, while SGLang's
# server exposes `sglang:<name>` (python/sglang/srt/observability/metrics_collector.py; PRs #33796
# and #36428 put the colon back in the dashboard): we expose what SGLang's server does.
DASHBOARD_SERIES = [
    "sglang:e2e_request_latency_seconds_bucket",
    "sglang:e2e_request_latency_seconds_sum",
    "sglang:e2e_request_latency_seconds_count",
    "sglang:time_to_first_token_seconds_bucket",
    "sglang:time_to_first_token_seconds_sum",
    "sglang:time_to_first_token_seconds_count",
    "sglang:num_running_reqs",
    "sglang:gen_throughput",
    "sglang:cache_hit_rate",
    "sglang:num_queue_reqs",
]
# The dashboard's template variables are label_values(model_name) and label_values(instance) (the
# latter Prometheus adds); its heatmaps filter {model_name=~"$model_name"}.
DASHBOARD_LABELS = {"model_name"}
# More of SGLang's series that dashboards built on it read (metrics_collector.py).
OTHER_SGLANG_SERIES = [
    "sglang:token_usage",
    "sglang:num_used_tokens",
    "sglang:prompt_tokens_total",
    "sglang:generation_tokens_total",
    "sglang:cached_tokens_total",
    "sglang:num_requests_total",
    "sglang:inter_token_latency_seconds_bucket",
    "sglang:queue_time_seconds_bucket",
    "sglang:realtime_tokens_total",
    "sglang:max_total_num_tokens",
]
# SGLang's label sets: TokenizerMetricsCollector's and SchedulerMetricsCollector's.
TOKENIZER_LABELS = {"model_name", "engine_type"}
SCHEDULER_LABELS = TOKENIZER_LABELS | {"tp_rank", "pp_rank", "moe_ep_rank"}
SGLANG_TTFT_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]

DECODE_LOG_INTERVAL = 4
PROMPT_IDS = list(range(10, 30))  # 20 tokens
MAX_NEW = 11  # 10 decode steps, or 11 under the overlap schedule (one after the last): 2 lines either way


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_llama")), max_position_embeddings=1024)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = [
        "--dtype", "float32", "--max-total-tokens", "16384", "--num-threads", "1",
        "--enable-metrics", "--log-requests", "--decode-log-interval", str(DECODE_LOG_INTERVAL),
    ]  # fmt: skip
    proc = launch_test_server(model_path, log, args)
    yield proc
    stop_test_server(proc)


@pytest.fixture(scope="module")
def first_request(server) -> dict:
    """The server's first request (so its prefill line is the first one in the log)."""
    body = {
        "input_ids": PROMPT_IDS,
        "rid": "obs-first",
        "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True},
    }
    r = httpx.post(server.base_url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def samples(server) -> list:
    r = httpx.get(server.base_url + "/metrics", timeout=60)
    assert r.status_code == 200, r.text
    return [s for family in text_string_to_metric_families(r.text) for s in family.samples]


def totals(server) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in samples(server):
        out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_prefill_and_decode_log_lines(server, first_request):
    log = server.log.read_text()
    prefill = re.findall(r"Prefill batch, (.*)", log)
    assert prefill, log
    fields, throughput = prefill[0].rsplit(", input throughput (token/s): ", 1)
    assert fields == (
        f"#new-seq: 1, #new-token: {len(PROMPT_IDS)}, #cached-token: 0, token usage: 0.00, "
        "#running-req: 0, #queue-req: 0, #pending-token: 0, cpu graph: False"
    )
    assert re.fullmatch(r"\d+\.\d\d", throughput) and float(throughput) > 0
    decode = re.findall(
        r"Decode batch, #running-req: (\d+), #token: (\d+), token usage: (\d+\.\d\d), cpu graph: False, "
        r"gen throughput \(token/s\): (\d+\.\d\d), #queue-req: (\d+)",
        log,
    )
    assert len(decode) == 2, log  # one line every DECODE_LOG_INTERVAL decode steps
    for running, tokens, usage, throughput, queued in decode:
        assert (running, usage, queued) == ("1", "0.00", "0")
        assert len(PROMPT_IDS) < int(tokens) <= len(PROMPT_IDS) + MAX_NEW
        assert float(throughput) > 0


def test_log_requests(server, first_request):
    log = server.log.read_text()
    received = [line for line in log.splitlines() if "Receive: obj=GenerateReqInput(" in line]
    assert any("rid='obs-first'" in line and str(PROMPT_IDS) in line for line in received), log
    finished = [line for line in log.splitlines() if "Finish: obj=GenerateReqInput(" in line]
    line = next(line for line in finished if "rid='obs-first'" in line)
    assert f"'output_ids': {first_request['output_ids']}" in line
    assert f"'completion_tokens': {MAX_NEW}" in line and "'finish_reason': {'type': 'length'" in line


def test_dashboard_series_and_labels(server, first_request):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "hello world this is a test"}]
    for _ in range(2):  # the second one hits the radix cache
        client.chat.completions.create(model=model, messages=messages, max_tokens=4)
    stream = client.completions.create(model=model, prompt="count: 1 2 3", max_tokens=4, stream=True)
    assert len(list(stream)) > 1

    found = samples(server)
    names = {s.name for s in found}
    missing = [n for n in DASHBOARD_SERIES + OTHER_SGLANG_SERIES if n not in names]
    assert not missing, f"missing: {missing}\npresent: {sorted(names)}"
    assert not [n for n in names if not n.startswith("sglang:")]
    for s in found:
        labels = set(s.labels) - {"le", "mode", "cache_source"}
        assert DASHBOARD_LABELS <= labels, s
        assert labels in (TOKENIZER_LABELS, SCHEDULER_LABELS), s
        assert s.labels["model_name"] == model and s.labels["engine_type"] == "unified"
    ttft = sorted(
        float(s.labels["le"]) for s in found if s.name == "sglang:time_to_first_token_seconds_bucket"
    )
    assert ttft == [*SGLANG_TTFT_BUCKETS, float("inf")]
    values = totals(server)
    assert values["sglang:num_requests_total"] == 4
    assert values["sglang:time_to_first_token_seconds_count"] == 4
    assert values["sglang:e2e_request_latency_seconds_count"] == 4
    assert values["sglang:cache_hit_rate"] > 0  # the repeated chat prompt
    assert values["sglang:cached_tokens_total"] > 0


def test_metrics_move_with_a_request(server, first_request):
    before = totals(server)
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(server.base_url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    after = totals(server)
    prompt_tokens = r.json()["meta_info"]["prompt_tokens"]
    assert after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"] == 5
    assert after["sglang:prompt_tokens_total"] - before["sglang:prompt_tokens_total"] == prompt_tokens
    assert after["sglang:num_requests_total"] - before["sglang:num_requests_total"] == 1
    assert after["sglang:inter_token_latency_seconds_count"] - before[
        "sglang:inter_token_latency_seconds_count"
    ] == 4  # fmt: skip
    assert after["sglang:num_running_reqs"] == 0 and after["sglang:num_queue_reqs"] == 0


@pytest.mark.parametrize("how", ["client_left", "abort_request"])
def test_an_aborted_request_counts_once_with_its_tokens(server, first_request, how):
    """A chat stream its client drops after the first chunk counts as an /abort_request abort does
    (as in SGLang, where a disconnect calls abort_request): one request, aborted, with the tokens
    it got and its latency."""
    rid, max_tokens, aborted = f"obs-aborted-{how}", 900, "sglang:num_aborted_requests_total"
    body = {"messages": [{"role": "user", "content": "a long one"}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "rid": rid}  # fmt: skip
    before = totals(server)
    sock = raw_post(server, "/v1/chat/completions", body)
    try:
        read_until(sock, b"data: ")  # the stream has started
        with children_paused(server):  # no more tokens until the abort is on its way
            if how == "client_left":
                sock.close()
                marker = f"client disconnected mid-stream; aborted request(s) {rid}"
                wait_until(lambda: marker in server.log.read_text(), "the disconnect was not seen")
            else:
                r = httpx.post(server.base_url + "/abort_request", json={"rid": rid}, timeout=60)
                assert r.status_code == 200, r.text
        wait_until(lambda: totals(server).get(aborted, 0) > before.get(aborted, 0), "no abort counted")
    finally:
        sock.close()
    after = totals(server)

    def added(name: str) -> float:
        return after[name] - before.get(name, 0)

    assert added(aborted) == 1
    assert added("sglang:num_requests_total") == 1
    assert added("sglang:e2e_request_latency_seconds_count") == 1
    assert added("sglang:time_to_first_token_seconds_count") == 1
    assert 1 <= added("sglang:generation_tokens_total") < max_tokens
    assert added("sglang:prompt_tokens_total") > 0


# Flags -----------------------------------------------------------------------------------------


def test_every_flag_has_help():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    missing = [
        a.option_strings[0] for a in parser._actions if a.option_strings and not (a.help or "").strip()
    ]
    assert not missing, f"flags without help: {missing}"


def test_device_auto():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert ServerArgs().device == expected and ServerArgs(device="auto").device == expected
    assert parse_args([]).device == expected
    assert ServerArgs(device="cpu").device == "cpu"


def test_random_seed_as_sglang():
    seeds = {ServerArgs().random_seed for _ in range(4)}
    assert all(isinstance(s, int) and 0 <= s <= 1 << 30 for s in seeds) and len(seeds) > 1
    assert ServerArgs(random_seed=7).random_seed == 7
    set_random_seed(7)
    drawn = (torch.rand(3), np.random.rand(3))
    set_random_seed(7)
    assert torch.equal(drawn[0], torch.rand(3)) and np.array_equal(drawn[1], np.random.rand(3))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a machine without CUDA")
@pytest.mark.parametrize(
    "flags, reason",
    [
        (["--device", "cuda"], "--device cuda: CUDA is not available here"),
        (
            ["--attention-backend", "triton"],
            "--attention-backend triton: the triton backend runs on CUDA only",
        ),
        (["--attention-backend", "flashinfer"], "radixengine has no flashinfer backend yet"),
    ],
)
def test_a_choice_that_cannot_run_here_is_refused_at_start(flags, reason, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(flags)
    assert e.value.code == 2 and reason in capsys.readouterr().err
    # The Engine's path (the same check, before the model is loaded).
    args = ServerArgs(**{flags[0][2:].replace("-", "_"): flags[1]})
    assert reason in runtime_support_error(args)


# Watchdog --------------------------------------------------------------------------------------


def test_watchdog_ends_a_forward_that_hangs(model_path, tmp_path):
    """Every forward sleeps an hour (a test-only hook of the worker): the watchdog ends the
    scheduler after --watchdog-timeout, the request fails with a message naming the timeout, and
    (with no restart allowed) the server exits with an error."""
    log = tmp_path / "server.log"
    port = get_free_port()
    cmd = [
        sys.executable, "-m", "radixengine.launch_server", "--model-path", model_path, "--port", str(port),
        "--dtype", "float32", "--max-total-tokens", "4096", "--num-threads", "1", "--watchdog-timeout", "2",
        "--max-scheduler-restarts", "0",
    ]  # fmt: skip
    env = {**subprocess_env(), TEST_FORWARD_STALL_ENV: "3600"}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, base, log)
        body = {"text": "hello", "sampling_params": {"max_new_tokens": 4}}
        r = httpx.post(base + "/generate", json=body, timeout=300)
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "ended by its watchdog" in message and "--watchdog-timeout 2 s" in message, message
        assert proc.wait(120) == 1
        text = log.read_text()
        assert "Scheduler watchdog timeout (--watchdog-timeout 2 s): a forward batch of 1 requests" in text, (
            text
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_healthy(proc, base: str, log) -> None:
    for _ in range(600):
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        try:
            proc.wait(0.5)  # a pause between polls that ends early if the server exits
        except subprocess.TimeoutExpired:
            pass
    raise AssertionError("the server did not become healthy:\n" + log.read_text())


def test_log_requests_levels(caplog):
    """SGLang's --log-requests-level: 0 metadata, 1 + sampling parameters, 2 + input / output cut
    to 2048 items, 3 everything."""
    obj = GenerateReqInput(input_ids=list(range(5000)), sampling_params={"max_new_tokens": 3}, rid="r1")
    out = {"text": "abc", "output_ids": [1, 2, 3], "meta_info": {"id": "r1", "completion_tokens": 3}}
    lines = {}
    for level in range(4):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="radixengine.managers.request_logger"):
            RequestLogger(True, level).log_finished(obj, out)
        lines[level] = caplog.records[0].getMessage()
    for level in (0, 1):
        assert "rid='r1'" in lines[level] and "'completion_tokens': 3" in lines[level]
        assert "input_ids" not in lines[level] and "output_ids" not in lines[level]
    assert "sampling_params" not in lines[0] and "sampling_params={'max_new_tokens': 3}" in lines[1]
    assert "input_ids=[0, 1, 2" in lines[2] and " ... [3976, " in lines[2] and "1500," not in lines[2]
    assert str(list(range(5000))) in lines[3] and "'output_ids': [1, 2, 3]" in lines[3]
    caplog.clear()
    RequestLogger(False, 3).log_finished(obj, out)
    assert not caplog.records


@pytest.mark.parametrize(
    "reason, aborted",
    [
        ({"type": "abort", "message": "aborted", "status_code": 499}, 1),
        ({"type": "abort", "message": "bad input", "status_code": 400}, 0),
        ({"type": "abort", "message": "queue full", "status_code": 503}, 0),
        ({"type": "length", "length": 3}, 0),
    ],
)
def test_only_an_abort_counts_as_aborted(reason, aborted):
    """As in SGLang: a request the scheduler refused counts as a request, not as an aborted one."""
    from radixengine.managers.metrics import TokenizerMetricsCollector

    metrics = TokenizerMetricsCollector("obs-refusals")
    meta = {"finish_reason": reason, "prompt_tokens": 4, "completion_tokens": 3, "cached_tokens": 0}
    metrics.observe_finished(meta, created=0.0, now=1.0)
    samples = {s.name: s.value for m in metrics.registry.collect() for s in m.samples}
    assert samples.get("sglang:num_aborted_requests_total", 0) == aborted
    assert samples["sglang:num_requests_total"] == 1


DASHBOARD = Path(__file__).resolve().parents[1] / "examples" / "monitoring" / "grafana-dashboard.json"
SERIES_NAME = re.compile(r"sglang[:_][A-Za-z0-9_:]*")
# The panels SGLang's dashboard has, and this engine's own.
DASHBOARD_PANELS = ["throughput", "time to first token", "inter-token latency", "end-to-end", "running and queued",
                    "token usage", "cache hit rate", "retractions"]  # fmt: skip


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    return exprs + [v["definition"] for v in dash["templating"]["list"] if v["type"] == "query"]


def test_shipped_dashboard_queries_series_metrics_exports(server, first_request):
    """Every query of examples/monitoring/grafana-dashboard.json names only series this server's
    /metrics exports (after one request), with its labels: the dashboard shows data."""
    dash = json.loads(DASHBOARD.read_text())
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    assert [t for t in DASHBOARD_PANELS if t not in titles] == []
    found = samples(server)
    names = {s.name for s in found}
    labels = set().union(*(s.labels for s in found)) | {"instance"}  # Prometheus adds instance
    for expr in dashboard_queries():
        used = SERIES_NAME.findall(expr)
        assert used, expr
        assert [n for n in used if n not in names] == [], expr
        assert set(re.findall(r"(\w+)=~", expr)) <= labels, expr
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
    assert "sglang:num_grammar_queue_reqs" in names and "sglang:num_retracted_requests_total" in names
