"""/tokenize and /detokenize (also under /v1), SGLang's bodies and answers: text or chat
messages to token ids with the server's tokenizer and chat template, and back."""

from __future__ import annotations

from fastapi import APIRouter, Request

from radixengine.entrypoints.openai_protocol import ChatCompletionRequest
from radixengine.entrypoints.openai_serving import chat_messages
from radixengine.entrypoints.request_fields import parse_json, parse_model, read_fields
from radixengine.managers.tokenizer_manager import RequestError, TokenizerManager

router = APIRouter()

TOKENIZE_FIELDS = ("model", "prompt", "messages", "add_special_tokens", "chat_template_kwargs",
                   "continue_final_message")  # fmt: skip


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(request: Request) -> dict:
    """`{"prompt": str | [str]}` or `{"messages": [...]}` (read as chat reads them: text parts
    joined) -> `{"tokens", "count", "max_model_len"}`."""
    tm: TokenizerManager = request.app.state.tokenizer_manager
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
        tokens = [tm.tokenizer.encode(p, add_special_tokens=add_special) for p in prompt]
        count = [len(t) for t in tokens]
    else:
        raise RequestError("prompt must be a string or a list of strings", param="prompt")
    return {"tokens": tokens, "count": count, "max_model_len": tm.context_len}


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(request: Request) -> dict:
    """`{"tokens": [int] | [[int]]}` -> `{"text": str | [str]}`."""
    tm: TokenizerManager = request.app.state.tokenizer_manager
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
