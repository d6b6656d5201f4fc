"""How a request body's top-level fields are read, as SGLang reads them: `null` means "unset", an
unknown field is ignored (logged once per route and name, at debug), and a known field whose
value would change the answer in a way this engine cannot give is refused with a 400 naming it
(its unset / false / empty value passes)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from radixengine.managers.request_errors import RequestError
from radixengine.utils.unicode_check import first_unencodable_path

logger = logging.getLogger(__name__)

_logged_unknown: set[tuple[str, str]] = set()

# Field -> why a set value cannot be honoured. Shared by the OpenAI routes and /generate.
UNHONOURED = {
    "return_hidden_states": "hidden states are not returned by this engine",
    "return_bytes": "output bytes are not returned by this engine",
    "return_entropy": "entropies are not returned by this engine",
    "return_routed_experts": "this engine serves no mixture-of-experts routing data",
    "background": "background requests are not supported",
    "image_data": "image inputs are not supported (text-only model)",
    "video_data": "video inputs are not supported (text-only model)",
    "audio_data": "audio inputs are not supported (text-only model)",
    "input_embeds": "input embeddings are not supported",
    "custom_logit_processor": "custom logit processors are not supported",
    "session_params": "sessions are not supported",
    "token_ids_logprob": "logprobs of chosen token ids are not supported",
    "functions": "OpenAI's legacy function calling is not supported: give the functions as tools",
}


# A `\uD800`-`\uDFFF` escape: the only way a UTF-8 body decodes to a lone surrogate (a UTF-16 or
# UTF-32 body, which JSON also allows, is walked whatever it holds).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


async def parse_json(request: Request) -> object:
    return loads_body(await request.body())


def loads_body(body: bytes) -> object:
    """The decoded body; a 400 for what is not JSON (too deeply nested included) and for a string
    or key UTF-8 cannot encode (a lone surrogate escape such as `"\\ud800"`), naming its path."""
    try:
        value = json.loads(body)
    except ValueError as e:  # not JSON, not UTF-8/16/32, an integer of more than 4300 digits
        raise RequestError(f"invalid JSON body: {e}", param="body") from None
    except RecursionError:
        raise RequestError("invalid JSON body: nested too deeply", param="body") from None
    if json.detect_encoding(body) != "utf-8" or _SURROGATE_ESCAPE.search(body):
        path = first_unencodable_path(value)
        if path is not None:
            raise RequestError(
                f"{path}: not valid Unicode text (a lone UTF-16 surrogate such as \\ud800)", param=path
            )
    return value


def read_fields(
    body: object, known: Iterable[str], route: str, unhonoured: Iterable[str] = UNHONOURED
) -> dict:
    """The body without its nulls and unknown fields; a set field of `unhonoured` is a 400."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object", param="body")
    known = set(known)
    for name in unhonoured:
        if body.get(name) not in (None, False, "", [], {}):
            raise RequestError(f"{name} is not supported: {UNHONOURED[name]}", param=name)
    fields = {}
    for name, value in body.items():
        if value is None:
            continue
        if name in known:
            fields[name] = value
        elif name not in UNHONOURED:
            log_unknown(route, name)
    return fields


def log_unknown(route: str, name: str) -> None:
    if (route, name) not in _logged_unknown:
        _logged_unknown.add((route, name))
        logger.debug("%s: ignoring the unknown field %r", route, name)


def validation_error_to_request_error(e: ValidationError) -> RequestError:
    err = e.errors()[0]
    param = _loc_to_param(err.get("loc", ()))
    return RequestError(f"{param}: {err.get('msg', 'invalid value')}", param=param)


def _loc_to_param(loc: tuple) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif "[" in item or item in ("str", "int", "float", "bool", "dict", "list", "none") or "-" in item:
            continue  # pydantic's union-member tags
        elif item[:1].isupper():
            continue  # a model's name: the union member it tried
        else:
            parts.append(("." if parts else "") + item)
    return "".join(parts) or "body"


def parse_model(model: type[BaseModel], body: object) -> BaseModel:
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object", param="body")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error_to_request_error(e) from None
