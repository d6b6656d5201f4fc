"""The storage tier as an operator sees it, through the real HTTP server: the per-tier hit rates,
prefetch and folder metrics on /metrics and /get_server_info, SGLang's
/hicache/storage-backend/clear (and /flush_cache leaving the folder, as in SGLang), and idle
gauges back at 0."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from test_engine_utils import build_tiny_model, launch_test_server, stop_test_server, wait_for_idle_accounting

PROMPT = [(i * 37 + 11) % 250 + 3 for i in range(120)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hicache-folder")


@pytest.fixture(scope="module")
def server(tmp_path_factory, folder):
    model = build_tiny_model(str(tmp_path_factory.mktemp("tiny_llama_hicache_http")))
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--dtype", "float32", "--max-total-tokens", "2048", "--num-threads", "1", "--enable-metrics",
            "--enable-hierarchical-cache", "--hicache-storage-backend", "file", "--hicache-storage-dir",
            str(folder), "--hicache-storage-prefetch-policy", "wait_complete"]  # fmt: skip
    proc = launch_test_server(model, log, args)
    yield proc
    stop_test_server(proc)


def info(server) -> dict:
    return wait_for_idle_accounting(
        lambda: httpx.get(server.base_url + "/get_server_info", timeout=60).json()
    )


def generate(server, ids: list[int]) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    return httpx.post(server.base_url + "/generate", json=body, timeout=120).json()


def pages(folder: Path) -> list[Path]:
    return sorted(folder.glob("*/*.kv"))


def wait_for_pages(folder: Path, count: int) -> None:
    deadline = time.monotonic() + 60
    while len(pages(folder)) < count:
        assert time.monotonic() < deadline, "pages not written"
        time.sleep(0.1)


def metric(text: str, name: str) -> float:
    lines = [
        ln
        for ln in text.splitlines()
        if ln.startswith(f"sglang:{name}{{") or ln.startswith(f"sglang:{name} ")
    ]
    assert lines, f"{name} not in /metrics"
    return float(lines[0].rsplit(" ", 1)[1])


def test_storage_metrics_clear_endpoint_and_flush_cache(server, folder):
    first = generate(server, PROMPT)
    wait_for_pages(folder, 7)
    # /flush_cache empties the tree, not the folder (SGLang's split): the next request reads storage.
    assert httpx.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    assert len(pages(folder)) >= 7
    again = generate(server, PROMPT)
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens_details"]["storage"] == 112
    state = info(server)
    assert state["storage_prefetches_in_flight"] == 0
    assert state["storage_prefetch_bytes"] == 0 and state["storage_prefetches"] >= 2
    assert state["storage_bytes"] > 0 and state["storage_max_bytes"] == 8 << 30
    rates = [state[f"cache_hit_rate_{t}"] for t in ("device", "host", "storage")]
    assert rates[2] > 0 and sum(rates) == pytest.approx(state["cache_hit_rate"])
    text = httpx.get(server.base_url + "/metrics", timeout=60).text
    assert metric(text, "hicache_storage_hit_rate") == pytest.approx(rates[2])
    assert metric(text, "hicache_storage_bytes") == state["storage_bytes"]
    assert metric(text, "hicache_storage_prefetches_total") >= 2
    assert metric(text, "hicache_storage_prefetch_misses_total") >= 1  # the first request's
    assert metric(text, "hicache_storage_prefetch_bytes") == 0

    cleared = httpx.post(server.base_url + "/hicache/storage-backend/clear", timeout=60)
    assert cleared.status_code == 200 and "pages deleted" in cleared.text
    assert pages(folder) == []
    assert httpx.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    third = generate(server, PROMPT)  # recomputed: nothing in the tree or the folder
    assert third["meta_info"]["cached_tokens"] == 0 and third["output_ids"] == first["output_ids"]
    wait_for_pages(folder, 7)  # and written again (the cleared keys are writable again)
