"""Structured outputs over HTTP with the official openai client: the default model (SmolLM2-135M
GGUF) answers `response_format` json_schema requests with JSON that parses and validates,
`regex` / `ebnf` extras with text that matches, streaming and n > 1 too; bad grammars are 400s
naming the field and the server keeps serving; `--grammar-backend none` refuses them."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from test_engine_utils import build_tiny_model, launch_test_server, stop_test_server

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "maxLength": 24},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                    },
                },
                "required": ["name", "address"],
            }
        },
        "required": ["person"],
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
        },
        "required": ["color", "size"],
    },
    "arrays": {
        "type": "object",
        "properties": {
            "fruits": {
                "type": "array",
                "items": {"type": "string", "maxLength": 16},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["fruits"],
    },
    "numbers": {
        "type": "object",
        "properties": {
            "temperature": {"type": "number", "minimum": -50, "maximum": 60},
            "count": {"type": "integer", "minimum": 0, "maximum": 1000},
        },
        "required": ["temperature", "count"],
    },
}
QUESTIONS = {
    "nested": "Describe a person and their address as JSON.",
    "enums": "Pick a t-shirt color and size. Answer in JSON.",
    "arrays": "List a few fruits as JSON.",
    "numbers": "What is the weather like today? Give a temperature and a count of clouds as JSON.",
}
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def server(gguf_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("grammar_server") / "server.log"
    proc = launch_test_server(gguf_path, log, ["--dtype", "float32", "--max-total-tokens", "16384"])
    yield proc
    stop_test_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def chat(client, content: str, **kwargs):
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": content}], **kwargs
    )


def json_schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_answers_parse_and_validate(client, name):
    out = chat(client, QUESTIONS[name], response_format=json_schema_format(name))
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


@pytest.mark.slow
def test_json_object_on_completions_and_chat(client):
    out = chat(
        client,
        "Reply with a small JSON object with two keys: the name and the age of a cat.",
        response_format={"type": "json_object"},
        max_tokens=400,
    )
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    comp = client.completions.create(
        model="default",
        prompt="A JSON object describing a dog:",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"response_format": json_schema_format("enums")},
    )
    assert comp.choices[0].finish_reason == "stop", comp.choices[0].text
    jsonschema.validate(json.loads(comp.choices[0].text), SCHEMAS["enums"])


@pytest.mark.slow
def test_regex_and_ebnf(client):
    regex = r"(Paris|London|Rome), [0-9]{4}"
    out = chat(client, "Name a European capital and a year.", extra_body={"regex": regex})
    assert re.fullmatch(regex, out.choices[0].message.content)
    comp = client.completions.create(
        model="default",
        prompt="Is the sky blue? Answer:",
        max_tokens=16,
        temperature=0,
        extra_body={"ebnf": 'root ::= " " ("yes" | "no") "."'},
    )
    assert comp.choices[0].text in (" yes.", " no.")


@pytest.mark.slow
def test_streaming_and_n_choices_are_valid(client):
    stream = chat(client, QUESTIONS["arrays"], response_format=json_schema_format("arrays"), stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS["arrays"])
    out = chat(
        client,
        QUESTIONS["numbers"],
        response_format=json_schema_format("numbers"),
        n=3,
        temperature=0.9,
        seed=5,
        logprobs=True,
        top_logprobs=2,
    )
    assert len(out.choices) == 3
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS["numbers"])
        assert all(t.logprob <= 0 for t in choice.logprobs.content)


@pytest.mark.slow
def test_free_requests_keep_their_tokens_beside_constrained_ones(client):
    free_q = "Write one sentence about the sea."
    alone = chat(client, free_q, max_tokens=40).choices[0].message.content
    with ThreadPoolExecutor(5) as pool:
        constrained = [
            pool.submit(chat, client, QUESTIONS[name], response_format=json_schema_format(name))
            for name in SCHEMAS
        ]
        free = pool.submit(chat, client, free_q, max_tokens=40)
        for name, fut in zip(SCHEMAS, constrained):
            jsonschema.validate(json.loads(fut.result().choices[0].message.content), SCHEMAS[name])
        assert free.result().choices[0].message.content == alone


BAD = [
    ({"extra_body": {"regex": "[a-z"}}, "regex", "regex"),
    ({"extra_body": {"ebnf": "root ::= "}}, "ebnf", "ebnf"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            }
        },
        "response_format",
        "json_schema",
    ),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ({"extra_body": {"regex": r"[^\s\S]"}}, "regex", "the regex matches no output"),
    (  # compiles (its start allows '"'), then dead-ends: a 400 naming the field while decoding
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "pattern": r"[^\s\S]"}},
            }
        },
        "response_format",
        "the json_schema matches no output",
    ),
    (  # a forced call whose arguments cannot be written
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {"a": {"type": "string", "pattern": r"[^\s\S]"}},
                            "required": ["a"],
                        },
                    },
                }
            ],
            "tool_choice": "required",
        },
        "tools",
        "matches no output",
    ),
    (
        {"response_format": {"type": "json_object"}, "extra_body": {"regex": "a+"}},
        "regex",
        "Only one of",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("kwargs,param,fragment", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_grammars_are_400_and_the_server_keeps_serving(client, kwargs, param, fragment):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", **kwargs)
    err = e.value.body
    assert err["param"] == param and fragment in err["message"], err
    assert chat(client, "hi", max_tokens=4).choices[0].message.content is not None


@pytest.mark.slow
def test_a_regex_that_matches_nothing_is_a_400_on_generate(server):
    """/generate with a regex no output can match is a 400 naming the regex (it was a 500 "no
    finite logits"); a regex that can match still answers with a match."""
    import httpx

    url = server.base_url + "/generate"
    params = {"max_new_tokens": 8, "temperature": 0, "regex": r"[^\s\S]"}
    r = httpx.post(url, json={"text": "hi", "sampling_params": params}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "regex" and "the regex matches no output" in err["message"], err
    params["regex"] = "(yes|no)"
    r = httpx.post(url, json={"text": "Is the sky blue?", "sampling_params": params}, timeout=60)
    assert r.status_code == 200 and r.json()["text"] in ("yes", "no"), r.text


@pytest.fixture(scope="module")
def no_grammar_server(tmp_path_factory):
    model = build_tiny_model(str(tmp_path_factory.mktemp("tiny_no_grammar")))
    log = tmp_path_factory.mktemp("no_grammar") / "server.log"
    proc = launch_test_server(model, log, ["--grammar-backend", "none", "--num-threads", "1"])
    yield proc
    stop_test_server(proc)


def test_grammar_backend_none_refuses_constrained_requests(no_grammar_server):
    client = openai.OpenAI(base_url=no_grammar_server.base_url + "/v1", api_key="none", max_retries=0)
    for kwargs in (
        {"response_format": {"type": "json_object"}},
        {"extra_body": {"regex": "a+"}},
    ):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, "hi", max_tokens=4, **kwargs)
        assert "--grammar-backend none" in e.value.body["message"]
    import httpx

    r = httpx.post(
        no_grammar_server.base_url + "/generate",
        json={"text": "hi", "sampling_params": {"max_new_tokens": 4, "json_schema": "{}"}},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "json_schema"
    assert chat(client, "hi", max_tokens=4).choices[0].finish_reason in ("stop", "length")
