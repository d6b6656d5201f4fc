"""The OpenAI-compatible API: /v1/completions, /v1/chat/completions and /v1/models (the logic
of requests and answers is in openai_serving)."""

from __future__ import annotations

from contextlib import contextmanager

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from radixengine.entrypoints import openai_serving as oai
from radixengine.entrypoints import openai_streams
from radixengine.entrypoints.http_errors import error_response
from radixengine.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from radixengine.entrypoints.request_fields import parse_json, parse_model
from radixengine.entrypoints.request_runner import collect_all, serve_requests, tm_of
from radixengine.managers.request_errors import RequestError
from radixengine.managers.tokenizer_manager import TokenizerManager

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    req = parse_model(CompletionRequest, await parse_json(request))
    with openai_params("prompt", "max_tokens"):
        return await _completions(request, req)


async def _completions(request: Request, req: CompletionRequest) -> Response:
    tm = tm_of(request)
    _fill_defaults(tm, req)
    objs, prompts = oai.completion_requests(tm, req)
    return await serve_requests(
        request,
        objs,
        lambda merged: openai_streams.completion_stream(tm, req, merged, prompts),
        lambda outs: oai.completion_response(tm, req, outs, prompts),
    )


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    req = parse_model(ChatCompletionRequest, await parse_json(request))
    max_tokens = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    with openai_params("messages", max_tokens):
        return await _chat_completions(request, req)


async def _chat_completions(request: Request, req: ChatCompletionRequest) -> Response:
    tm = tm_of(request)
    _fill_defaults(tm, req)
    oai.apply_sampling_defaults(req, tm.default_sampling_params)
    objs = oai.chat_requests(tm, req)
    return await serve_requests(
        request,
        objs,
        lambda merged: openai_streams.chat_stream(tm, req, merged),
        lambda outs: oai.chat_response(tm, req, outs),
    )


def _fill_defaults(tm: TokenizerManager, req: CompletionRequest | ChatCompletionRequest) -> None:
    """The answer names the model the request named (SGLang's rule), else the served name."""
    req.model = req.model or tm.served_model_name
    if req.seed is None:
        req.seed = req.sampling_seed


async def answer_body(tm: TokenizerManager, url: str, body: dict, interactive: bool = True) -> dict:
    """The JSON answer of one non-streaming chat or completions body (with `interactive` False, a
    batch line: see managers/req.py); a refusal raises RequestError as the route would answer it."""
    if url == "/v1/chat/completions":
        req = parse_model(ChatCompletionRequest, body)
        max_tokens = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        names = ("messages", max_tokens)
    else:
        req = parse_model(CompletionRequest, body)
        names = ("prompt", "max_tokens")
    if req.stream:
        raise RequestError("stream is not supported in a batch", param="stream")
    with openai_params(*names):
        _fill_defaults(tm, req)
        if isinstance(req, ChatCompletionRequest):
            oai.apply_sampling_defaults(req, tm.default_sampling_params)
            objs = oai.chat_requests(tm, req)
        else:
            objs, prompts = oai.completion_requests(tm, req)
        for obj in objs:
            obj.interactive = interactive
        outs = await collect_all(tm, objs)
    if isinstance(req, ChatCompletionRequest):
        return oai.chat_response(tm, req, outs)
    return oai.completion_response(tm, req, outs, prompts)


@contextmanager
def openai_params(prompt_param: str, max_tokens_param: str):
    """Name the OpenAI field in errors the engine reports under its own names."""
    names = {
        "text": prompt_param,
        "input_ids": prompt_param,
        "messages": prompt_param,
        "max_new_tokens": max_tokens_param,
        "min_new_tokens": "min_tokens",
        "sampling_seed": "seed",
    }
    try:
        yield
    except RequestError as e:
        e.param = names.get(e.param, e.param)
        raise


@router.get("/v1/models")
async def models(request: Request) -> dict:
    tm = tm_of(request)
    adapters = [
        ModelCard(id=ref.lora_name, root=ref.lora_path, parent=tm.served_model_name)
        for ref in tm.lora.registry.refs()
    ]
    return ModelList(data=[_card(tm), *adapters]).model_dump()


@router.get("/v1/models/{model:path}")
async def retrieve_model(request: Request, model: str) -> Response:
    tm = tm_of(request)
    if model in tm.lora.registry:
        ref = tm.lora.registry.resolve(model)
        return JSONResponse(ModelCard(id=model, root=ref.lora_path, parent=tm.served_model_name).model_dump())
    if model != tm.served_model_name:
        return error_response(f"The model {model!r} does not exist", 404, param="model")
    return JSONResponse(_card(tm).model_dump())


def _card(tm: TokenizerManager) -> ModelCard:
    return ModelCard(id=tm.served_model_name, root=tm.served_model_name, max_model_len=tm.context_len)
