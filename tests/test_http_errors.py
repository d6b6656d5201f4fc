"""HTTP status mapping of engine outcomes, in-process with a stub tokenizer manager: a full queue
is 503 (streaming or not), a dead engine 503, an internal error 500 — all as error JSON."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from radixengine.entrypoints.http_server import create_app
from radixengine.managers.io_struct import finish_abort
from radixengine.managers.tokenizer_manager import EngineDeadError
from radixengine.server_args import ServerArgs


class StubTokenizerManager:
    served_model_name = model_path = "stub"
    context_len = 64
    dead_error = None
    metrics = None
    scheduler_info: dict = {}
    default_sampling_params: dict = {}

    def __init__(self, outcome: str) -> None:
        self.outcome = outcome
        self.server_args = ServerArgs(model_path="stub")

    def ensure_started(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    async def generate_request(self, obj):
        await asyncio.sleep(0)
        if self.outcome == "dead":
            raise EngineDeadError("the scheduler process (pid 1) died unexpectedly (exit code -9)")
        if self.outcome == "boom":
            raise RuntimeError("boom")
        meta = {"id": "x", "prompt_tokens": 1, "completion_tokens": 0, "cached_tokens": 0, "e2e_latency": 0.0,
                "finish_reason": finish_abort("The request queue is full.", 503, "ServiceUnavailableError")}  # fmt: skip
        yield {"text": "", "output_ids": [], "meta_info": meta}


async def call(outcome: str, path: str, body: dict) -> httpx.Response:
    tm = StubTokenizerManager(outcome)
    app = create_app(tm, tm.server_args)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post(path, json=body)


CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/generate", {"text": "hi"})])
def test_full_queue_is_503(path, body, stream):
    r = asyncio.run(call("full", path, {**body, "stream": stream}))
    assert r.status_code == 503
    assert r.json()["error"] == {
        "message": "The request queue is full.", "type": "ServiceUnavailableError", "param": None, "code": 503
    }  # fmt: skip


def test_dead_engine_is_503_and_internal_error_is_500():
    r = asyncio.run(call("dead", "/v1/chat/completions", CHAT))
    assert r.status_code == 503 and "died" in r.json()["error"]["message"]
    r = asyncio.run(call("boom", "/generate", {"text": "hi"}))
    assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
