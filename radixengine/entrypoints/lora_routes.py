"""SGLang's LoRA adapter routes: POST /load_lora_adapter and /unload_lora_adapter (docs/lora.md).
Unloading waits for the adapter's requests in flight; new requests naming it get a 400 at once."""

from __future__ import annotations

from fastapi import APIRouter, Request

from radixengine.entrypoints.request_fields import parse_json, read_fields
from radixengine.entrypoints.request_runner import tm_of
from radixengine.managers.request_errors import RequestError
from radixengine.managers.tokenizer_manager import TokenizerManager

router = APIRouter()


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request) -> dict:
    body = read_fields(await parse_json(request), ("lora_name", "lora_path", "pinned"), "/load_lora_adapter")
    name, path = _string(body, "lora_name"), _string(body, "lora_path")
    pinned = body.get("pinned", False)
    if not isinstance(pinned, bool):
        raise RequestError("pinned must be a boolean", param="pinned")
    tm = tm_of(request)
    await tm.lora.load(name, path, pinned)
    return _answer(tm)


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> dict:
    body = read_fields(await parse_json(request), ("lora_name",), "/unload_lora_adapter")
    tm = tm_of(request)
    await tm.lora.unload(_string(body, "lora_name"))
    return _answer(tm)


def _string(body: dict, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise RequestError(f"{name} must be a non-empty string", param=name)
    return value


def _answer(tm: TokenizerManager) -> dict:
    """SGLang's answer: success and the adapters loaded now (name -> path)."""
    return {"success": True, "error_message": None, "loaded_adapters": tm.lora.loaded()}
