"""What the server is and how loaded it is, in SGLang's shapes (what sglang-router,
bench_serving and the OpenAI clients read): /model_info, /server_info, /v1/models, /v1/loads."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from datetime import datetime, timezone

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from radixengine import __version__
from radixengine.entrypoints.http_errors import error_response
from radixengine.entrypoints.openai_protocol import ModelCard, ModelList
from radixengine.managers.tokenizer_manager import TokenizerManager

router = APIRouter()


def _tm(request: Request) -> TokenizerManager:
    return request.app.state.tokenizer_manager


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request) -> dict:
    tm = _tm(request)
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
    tm = _tm(request)
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
    info.update(state)
    info["internal_states"] = [state]
    return info


@router.get("/v1/models")
async def models(request: Request) -> dict:
    return ModelList(data=[_card(_tm(request))]).model_dump()


@router.get("/v1/models/{model:path}")
async def retrieve_model(request: Request, model: str) -> Response:
    tm = _tm(request)
    if model != tm.served_model_name:
        return error_response(f"The model {model!r} does not exist", 404, param="model")
    return JSONResponse(_card(tm).model_dump())


def _card(tm: TokenizerManager) -> ModelCard:
    return ModelCard(id=tm.served_model_name, root=tm.served_model_name, max_model_len=tm.context_len)


@router.get("/v1/loads")
async def loads(request: Request, include: str | None = None, format: str | None = None) -> Response:
    """SGLang's load snapshot (one rank; `include` takes core or all: this engine has no other
    section), plus the `aggregate` that sglang-router's load monitor reads."""
    sections = {s.strip() for s in include.split(",")} if include else {"all"}
    if not sections <= {"core", "all"}:
        bad = sorted(sections - {"core", "all"})
        return error_response(f"include: unknown section(s) {bad}; valid: core, all", 400, param="include")
    load = await _load(_tm(request))
    if format == "prometheus":
        lines = [
            f'# TYPE sglang_{k} gauge\nsglang_{k}{{dp_rank="0"}} {v}'
            for k, v in load.items()
            if k != "dp_rank"
        ]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")
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
    load = await _load(_tm(request))
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
