"""Operating the server: liveness (/health, /health_generate), Prometheus /metrics, clearing the
storage tier (/hicache/storage-backend/clear), and what the
server is and how loaded it is in SGLang's shapes (what sglang-router and bench_serving read):
/model_info, /server_info, /v1/loads, /get_load."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from datetime import datetime, timezone

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from radixengine import __version__
from radixengine.entrypoints.http_errors import error_response
from radixengine.entrypoints.request_runner import tm_of
from radixengine.managers.io_struct import GenerateReqInput
from radixengine.managers.request_errors import EngineDeadError, RequestError
from radixengine.managers.tokenizer_manager import TokenizerManager, collect

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    tm = tm_of(request)
    if tm.dead_error is not None:
        return error_response(tm.dead_error, 503)
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    obj = GenerateReqInput(
        input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0}, log_metrics=False
    )
    try:
        await asyncio.wait_for(collect(tm_of(request), obj), timeout=60)
    except (RequestError, EngineDeadError, asyncio.TimeoutError) as e:
        return error_response(f"health check failed: {e}", 503)
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    tm = tm_of(request)
    if tm.metrics is None:
        return error_response("metrics are disabled (--enable-metrics is off)", 404)
    try:
        state = await tm.get_internal_state()
    except (asyncio.TimeoutError, EngineDeadError):
        state = None
    return Response(tm.metrics.render(state), media_type=PROMETHEUS_TEXT)


PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@router.post("/hicache/storage-backend/clear")
async def clear_hicache_storage(request: Request) -> Response:
    """SGLang's: delete the storage tier's pages (/flush_cache leaves them, as in SGLang)."""
    try:
        result = await tm_of(request).clear_hicache_storage()
    except EngineDeadError as e:
        return error_response(str(e), 503)
    if not result.success:
        return error_response(result.message, 400)
    return Response(result.message + "\n", media_type="text/plain")


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request) -> dict:
    tm = tm_of(request)
    config = _hf_config(tm)
    return {
        "model_path": tm.model_path,
        "resolved_model_path": tm.resolved_model_path,
        "tokenizer_path": tm.tokenizer_path,
        "served_model_name": tm.served_model_name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
    }


def _hf_config(tm: TokenizerManager) -> dict:
    path = os.path.join(tm.hf_dir or "", "config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> dict:
    """The flags, the worker's limits and the scheduler's state: flat (as before) and as
    SGLang's `internal_states` list."""
    tm = tm_of(request)
    state = await tm.get_internal_state()
    info = dataclasses.asdict(tm.server_args)
    info.update(
        model_path=tm.model_path,
        resolved_model_path=tm.resolved_model_path,
        tokenizer_path=tm.tokenizer_path,
        served_model_name=tm.served_model_name,
        tp_size=1,
        dp_size=1,
        version=__version__,
        default_sampling_params=tm.default_sampling_params,
    )
    info.update({k: v for k, v in tm.scheduler_info.items() if k != "status"})
    info["max_total_tokens"] = tm.scheduler_info.get("max_total_num_tokens")
    info["scheduler_restarts"] = tm.scheduler_restarts
    info["scheduler_pid"] = next((proc.pid for name, proc in tm.processes if name == "scheduler"), None)
    info.update(state)
    info["internal_states"] = [state]
    return info


@router.get("/v1/loads")
async def loads(request: Request, include: str | None = None, format: str | None = None) -> Response:
    """SGLang's load snapshot (one rank; `include` takes core or all: this engine has no other
    section), plus the `aggregate` that sglang-router's load monitor reads."""
    sections = {s.strip() for s in include.split(",")} if include else {"all"}
    if not sections <= {"core", "all"}:
        bad = sorted(sections - {"core", "all"})
        return error_response(f"include: unknown section(s) {bad}; valid: core, all", 400, param="include")
    load = await _load(tm_of(request))
    if format == "prometheus":
        lines = [
            f'# TYPE sglang_{k} gauge\nsglang_{k}{{dp_rank="0"}} {v}'
            for k, v in load.items()
            if k != "dp_rank"
        ]
        return Response("\n".join(lines) + "\n", media_type=PROMETHEUS_TEXT)
    aggregate = {
        "total_running_reqs": load["num_running_reqs"],
        "total_waiting_reqs": load["num_waiting_reqs"],
        "total_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
        "total_tokens": load["num_total_tokens"],
    }
    now = datetime.now(timezone.utc).isoformat()
    return JSONResponse({"timestamp": now, "version": __version__, "loads": [load], "aggregate": aggregate})


@router.get("/get_load")
async def get_load(request: Request) -> list[dict]:
    """SGLang's older load shape, one entry per rank."""
    load = await _load(tm_of(request))
    return [
        {
            "dp_rank": 0,
            "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
            "num_waiting_reqs": load["num_waiting_reqs"],
            "num_tokens": load["num_total_tokens"],
            "num_pending_tokens": load["num_total_tokens"] - load["num_used_tokens"],
            "ts_tic": time.perf_counter(),
        }
    ]


async def _load(tm: TokenizerManager) -> dict:
    """SGLang's core load keys from the scheduler's state (KV in the cache but evictable counts
    as free, as in SGLang)."""
    s = await tm.get_internal_state()
    total = s["max_total_tokens"]
    used = total - s["available_tokens"] - s["evictable_tokens"]
    queued = s.get("num_queue_tokens", 0)
    running = s["num_running_reqs"]
    return {
        "timestamp": time.time(),
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": s["num_queue_reqs"],
        "num_waiting_uncached_tokens": queued,
        "num_used_tokens": used,
        "num_total_tokens": used + queued,
        "max_total_num_tokens": total,
        "max_running_requests": tm.scheduler_info.get("max_running_requests", 0),
        "token_usage": round(used / total, 4) if total else 0.0,
        "gen_throughput": round(s.get("gen_throughput", 0.0), 2),
        "cache_hit_rate": round(s.get("cache_hit_rate", 0.0), 4),
        "utilization": round(running / tm.scheduler_info["max_running_requests"], 4)
        if tm.scheduler_info.get("max_running_requests")
        else 0.0,
    }
