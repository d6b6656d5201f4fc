"""docs/api.md cannot drift from the app: every route the app serves (with its methods) is a
heading there and every heading is a route; every request field the chat, completions, responses
and /generate routes read is named in its section."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

from radixengine.entrypoints.http_server import create_app
from radixengine.entrypoints.native_routes import NATIVE_COMPAT_FIELDS, NATIVE_FIELDS
from radixengine.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from radixengine.entrypoints.responses_protocol import ResponsesRequest
from radixengine.sampling.sampling_params import SamplingParams
from radixengine.server_args import ServerArgs

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"
FASTAPI_OWN = {("GET", p) for p in ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")}
HEADING = re.compile(r"^#{2,4} (.*)$", re.M)
ENDPOINT = re.compile(r"`([A-Z]+(?:, [A-Z]+)*) (/[^`\s]*)`")


def app_routes() -> set[tuple[str, str]]:
    app = create_app(object(), ServerArgs(model_path="unused"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one function under several methods: duplicate operation ids
        paths = app.openapi()["paths"]
    return {(method.upper(), path) for path, ops in paths.items() for method in ops} | FASTAPI_OWN


def sections() -> dict[tuple[str, str], str]:
    """(method, path) -> the text of the section its heading opens."""
    text = DOC.read_text()
    heads = list(HEADING.finditer(text))
    out = {}
    for i, head in enumerate(heads):
        body = text[head.end() : heads[i + 1].start() if i + 1 < len(heads) else len(text)]
        for methods, path in ENDPOINT.findall(head.group(1)):
            for method in methods.split(", "):
                out[(method, path)] = body
    return out


def test_every_route_is_documented_and_every_documented_route_exists():
    documented, served = set(sections()), app_routes()
    assert served - documented == set(), "routes missing from docs/api.md"
    assert documented - served == set(), "docs/api.md lists routes the app does not have"


def test_every_request_field_is_named_in_its_section():
    docs = sections()
    expected = {
        ("POST", "/v1/chat/completions"): set(ChatCompletionRequest.model_fields),
        ("POST", "/v1/completions"): set(CompletionRequest.model_fields) - set(ChatCompletionRequest.model_fields),
        ("POST", "/v1/responses"): set(ResponsesRequest.model_fields),
        ("POST", "/generate"): NATIVE_FIELDS | NATIVE_COMPAT_FIELDS
        | {f for f in SamplingParams.__dataclass_fields__ if SamplingParams.__dataclass_fields__[f].init},
    }  # fmt: skip
    for route, fields in expected.items():
        missing = sorted(f for f in fields if f"`{f}`" not in docs[route])
        assert missing == [], f"{route}: fields not in docs/api.md: {missing}"
