"""A bounded soak of the real server: many concurrent clients at once through a pool too small for
them, streaming and not, clients that disconnect mid-stream or time out, stop strings and
min_new_tokens, priorities, both event loops (one with mixed chunked prefill). Every request that
stays connected finishes (greedy ones with transformers' tokens), the server stays up, and once
idle no KV token has leaked. How often the server retracts or preempts here depends on timing, so
it is not asserted; tests/test_scheduler_soak.py drives those paths deterministically."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
import torch
from test_engine_utils import build_tiny_model, hf_greedy, launch_test_server, load_hf_model, stop_test_server

NUM_CLIENTS = 72
SERVER_VARIANTS = {
    "overlap-mixed": ["--cpu-forward-stream", "thread", "--enable-mixed-chunk"],
    "normal": ["--disable-overlap-schedule"],
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("soak_llama")))


@pytest.fixture(scope="module")
def hf_model(model_path):
    torch.set_num_threads(1)
    return load_hf_model(model_path, dtype=torch.float32)


@pytest.fixture(scope="module", params=list(SERVER_VARIANTS))
def server(request, model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("soak_server") / "server.log"
    args = [
        "--dtype", "float32", "--num-threads", "1", "--test-mode",
        "--max-total-tokens", "640", "--chunked-prefill-size", "64", "--max-prefill-tokens", "256",
        "--enable-priority-scheduling", "--init-new-token-ratio", "0.05",
        *SERVER_VARIANTS[request.param],
    ]  # fmt: skip
    proc = launch_test_server(model_path, log, args)
    yield proc
    stop_test_server(proc)


def client_plan(seed: int) -> list[dict]:
    """What each client does: its prompt, parameters, and how it behaves."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 200) for _ in range(40)]
    plan = []
    for i in range(NUM_CLIENTS):
        prompt = (shared if rng.random() < 0.6 else []) + [
            rng.randrange(3, 200) for _ in range(rng.randint(4, 60))
        ]
        params = {"max_new_tokens": rng.randint(8, 64), "temperature": 0, "ignore_eos": True}
        kind = ("greedy", "stream", "disconnect", "stops", "timeout", "greedy")[i % 6]
        if kind == "stops":
            params.update(ignore_eos=False, stop=["e", "th"], min_new_tokens=rng.randint(1, 4))
        plan.append(
            dict(rid=f"soak-{seed}-{i}", kind=kind, ids=prompt, params=params, priority=rng.randint(0, 40))
        )
    return plan


async def run_client(http: httpx.AsyncClient, c: dict, delay: float) -> dict:
    await asyncio.sleep(delay)
    body = {"input_ids": c["ids"], "sampling_params": c["params"], "rid": c["rid"], "priority": c["priority"]}
    if c["kind"] in ("stream", "disconnect"):
        body["stream"] = True
        events = []
        async with http.stream("POST", "/generate", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                events.append(json.loads(line[6:]))
                if c["kind"] == "disconnect" and len(events) == 2:
                    return {"disconnected": True}  # leaving the block closes the connection
        return {"status": 200, "body": events[-1]}
    timeout = 0.05 if c["kind"] == "timeout" else 120
    try:
        resp = await http.post("/generate", json=body, timeout=timeout)
    except httpx.TimeoutException:
        return {"disconnected": True}
    return {"status": resp.status_code, "body": resp.json()}


async def soak(base_url: str, plan: list[dict]) -> list[dict]:
    rng = random.Random(7)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        return await asyncio.gather(*(run_client(http, c, rng.random() * 0.05) for c in plan))


def wait_idle_without_leaks(base_url: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(base_url + "/get_server_info", timeout=10).json()
        total = info["available_tokens"] + info["evictable_tokens"] + info["protected_tokens"]
        if (
            info["num_running_reqs"] == 0
            and info["num_queue_reqs"] == 0
            and total == info["max_total_tokens"]
        ):
            return info
        assert time.monotonic() < deadline, f"not idle, or tokens leaked: {info}"
        time.sleep(0.2)


def test_soak_of_concurrent_clients(server, hf_model):
    plan = client_plan(seed=11)
    results = asyncio.run(soak(server.base_url, plan))
    assert server.poll() is None, server.log.read_text()[-3000:]
    for c, res in zip(plan, results):
        if res.get("disconnected"):
            continue
        assert res["status"] == 200, (c["rid"], res)
        body = res["body"]
        reason = body["meta_info"]["finish_reason"]
        if c["kind"] == "stops":
            assert reason["type"] in ("stop", "length"), (c["rid"], reason)
            continue
        assert reason["type"] == "length", (c["rid"], reason)
        expected = hf_greedy(hf_model, [c["ids"]], c["params"]["max_new_tokens"])[0]
        assert body["output_ids"] == expected, c["rid"]
    wait_idle_without_leaks(server.base_url)
    # Still serving, and correctly.
    last = client_plan(seed=12)[0]
    res = asyncio.run(soak(server.base_url, [last]))[0]
    assert (
        res["body"]["output_ids"] == hf_greedy(hf_model, [last["ids"]], last["params"]["max_new_tokens"])[0]
    )
