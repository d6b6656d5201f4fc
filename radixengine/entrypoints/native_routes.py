"""SGLang's native API: /generate, /abort_request, /flush_cache, /tokenize and /detokenize (also
under /v1), SGLang's paths, bodies and answers."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from radixengine.entrypoints.http_errors import error_response
from radixengine.entrypoints.openai_protocol import ChatCompletionRequest
from radixengine.entrypoints.openai_serving import chat_messages
from radixengine.entrypoints.request_fields import parse_json, parse_model, read_fields
from radixengine.entrypoints.request_runner import serve_requests, tm_of
from radixengine.managers.io_struct import MAX_BATCH_REQUESTS, GenerateReqInput
from radixengine.managers.request_errors import RequestError, abort_to_error, is_abort, is_requested_abort

router = APIRouter()


# /generate ------------------------------------------------------------------------------------

NATIVE_FIELDS = {
    "text", "input_ids", "sampling_params", "stream", "rid", "priority", "return_logprob", "top_logprobs_num",
    "logprob_start_len", "return_text_in_logprobs", "routing_key", "lora_path",
}  # fmt: skip
# Accepted for SGLang's clients (sglang-router adds them): `model` names the one model, `no_logs`
# changes nothing here, `log_metrics: false` keeps the request out of the metrics.
NATIVE_COMPAT_FIELDS = {"model", "no_logs", "log_metrics"}


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request) -> Response:
    objs, single = native_requests(await parse_json(request))
    return await serve_requests(
        request,
        objs,
        lambda merged: _native_events(merged, single),
        lambda outs: outs[0] if single else outs,
        keep_requested_aborts=True,
    )


def native_requests(body: object) -> tuple[list[GenerateReqInput], bool]:
    """SGLang's /generate body, normalised as every front end's is (see
    `GenerateReqInput.normalize_batch_and_arguments`): text or input_ids, one prompt or a batch;
    the answer is a list when several prompts or samples were asked for. A null field is unset;
    an unknown top-level field is ignored (one inside sampling_params is an error)."""
    body = read_fields(body, NATIVE_FIELDS | NATIVE_COMPAT_FIELDS, "/generate")
    if not isinstance(body.get("no_logs", False), bool):
        raise RequestError("no_logs must be a boolean", param="no_logs")
    fields = {name: value for name, value in body.items() if name not in ("model", "no_logs")}
    return GenerateReqInput(**fields).normalize_batch_and_arguments()


async def _native_events(merged: AsyncIterator[tuple[int, dict]], single: bool) -> AsyncIterator[dict]:
    """A single request's outputs, or several requests' outputs as they come, each with the
    `index` of its request (SGLang's batch stream). An abort ends its request with a normal
    output whose finish_reason is the abort (SGLang's); only a refusal before any output is an
    error, which the stream's first event turns into the answer's HTTP status."""
    started = False
    try:
        async for i, out in merged:
            if not started and is_abort(out) and not is_requested_abort(out):
                raise abort_to_error(out)
            started = True
            yield out if single else {**out, "index": i}
    finally:
        await merged.aclose()


# Control --------------------------------------------------------------------------------------


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    """`{"rid": ...}` or `{"abort_all": true}`: the request(s) end at once; their clients get the
    abort as the answer (/generate: an output whose finish_reason is the abort, status_code 499;
    the OpenAI routes: a 499 error). 200 whether or not the rid was running (as SGLang)."""
    body = read_fields(await parse_json(request), ("rid", "abort_all", "abort_message"), "/abort_request")
    rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
    if not isinstance(rid, str):
        raise RequestError("rid must be a string", param="rid")
    if not isinstance(abort_all, bool):
        raise RequestError("abort_all must be a boolean", param="abort_all")
    if not rid and not abort_all:
        raise RequestError("give a rid, or abort_all: true", param="rid")
    tm_of(request).abort_for_client(rid, abort_all)
    return Response(status_code=200)


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    result = await tm_of(request).flush_cache()
    if not result.success:
        return error_response(result.message or "cannot flush the cache while requests run", 400)
    return PlainTextResponse("Cache flushed.\n")


# Tokenizer ------------------------------------------------------------------------------------

TOKENIZE_FIELDS = ("model", "prompt", "messages", "add_special_tokens", "chat_template_kwargs",
                   "continue_final_message")  # fmt: skip


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(request: Request) -> dict:
    """`{"prompt": str | [str]}` or `{"messages": [...]}` (read as chat reads them: text parts
    joined) -> `{"tokens", "count", "max_model_len"}`."""
    tm = tm_of(request)
    body = read_fields(await parse_json(request), TOKENIZE_FIELDS, "/tokenize")
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise RequestError("give exactly one of prompt or messages", param="prompt")
    add_special = _bool(body, "add_special_tokens", True)
    if messages is not None:
        chat = parse_model(ChatCompletionRequest, {"messages": messages})
        text = tm.apply_chat_template(
            chat_messages(chat),
            body.get("chat_template_kwargs"),
            _bool(body, "continue_final_message", False),
        )
        tokens = tm.tokenizer.encode(text, add_special_tokens=False)
        count = len(tokens)
    elif isinstance(prompt, str):
        tokens = tm.tokenizer.encode(prompt, add_special_tokens=add_special)
        count = len(tokens)
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        if len(prompt) > MAX_BATCH_REQUESTS:
            raise RequestError(
                f"prompt has {len(prompt)} texts; at most {MAX_BATCH_REQUESTS}", param="prompt"
            )
        tokens = [tm.tokenizer.encode(p, add_special_tokens=add_special) for p in prompt]
        count = [len(t) for t in tokens]
    else:
        raise RequestError("prompt must be a string or a list of strings", param="prompt")
    return {"tokens": tokens, "count": count, "max_model_len": tm.context_len}


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(request: Request) -> dict:
    """`{"tokens": [int] | [[int]]}` -> `{"text": str | [str]}`."""
    tm = tm_of(request)
    body = read_fields(await parse_json(request), ("model", "tokens", "skip_special_tokens"), "/detokenize")
    tokens = body.get("tokens")
    skip = _bool(body, "skip_special_tokens", True)
    if _is_ids(tokens, tm.vocab_size):
        return {"text": tm.tokenizer.decode(tokens, skip_special_tokens=skip)}
    if isinstance(tokens, list) and tokens and all(_is_ids(t, tm.vocab_size) for t in tokens):
        return {"text": [tm.tokenizer.decode(t, skip_special_tokens=skip) for t in tokens]}
    raise RequestError(
        f"tokens must be a list of token ids in [0, {tm.vocab_size}) or a list of such lists", param="tokens"
    )


def _is_ids(value: object, vocab_size: int) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in value
    )


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean", param=name)
    return value
