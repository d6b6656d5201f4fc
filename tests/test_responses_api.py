"""/v1/responses through the official openai client against a real server (a tiny random Llama
with a Qwen2.5-style template and `--tool-call-parser qwen25`): every answer is the chat path's
answer to the same conversation (greedy), stored responses come back from GET and continue with
previous_response_id (a radix cache hit), the stream is the Responses event sequence and adds up
to the whole answer, function calls go round trip, text.format runs through the grammar backend
(`responses.parse`), background responses can be cancelled, and what the server cannot do is a
400 naming the field. A second server with `--reasoning-parser deepseek-r1` gives reasoning items.
LangChain's `ChatOpenAI(use_responses_api=True)` and `litellm.responses()` get the same answers."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from test_engine_utils import build_tiny_model, children_paused, launch_test_server, stop_test_server
from test_http import assert_idle_accounting
from test_tool_calls import QWEN_STYLE_TEMPLATE, SETTINGS

from radixengine.entrypoints.response_store import ResponseStore, StoredResponse

PROMPT = "hello world this is a test"
GREEDY = {"temperature": 0}
TOOL = {"type": "function", "name": "set_units", "parameters": SETTINGS["function"]["parameters"]}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("responses")
    path = build_tiny_model(str(root / "model"), max_position_embeddings=4096)
    template = root / "template.jinja"
    template.write_text(QWEN_STYLE_TEMPLATE)
    return path, str(template), root


def _serve(model, log_name: str, *extra: str):
    path, template, root = model
    args = ["--dtype", "float32", "--num-threads", "1", "--max-total-tokens", "16384", "--chat-template",
            template, "--tool-call-parser", "qwen25", "--constrained-json-disable-any-whitespace", *extra]  # fmt: skip
    return launch_test_server(path, root / log_name, args)


@pytest.fixture(scope="module")
def server(model):
    proc = _serve(model, "server.log")
    yield proc
    stop_test_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def chat(client, messages, **kw):
    return client.chat.completions.create(model="m", messages=messages, **GREEDY, **kw)


def test_create_is_the_chat_answer(client):
    r = client.responses.create(model="m", input=PROMPT, max_output_tokens=6, extra_body={"ignore_eos": True},
                                **GREEDY)  # fmt: skip
    c = chat(client, [{"role": "user", "content": PROMPT}], max_tokens=6, extra_body={"ignore_eos": True})
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "m"
    assert r.output_text == c.choices[0].message.content
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.usage.input_tokens == c.usage.prompt_tokens and r.usage.output_tokens == 6
    assert r.usage.total_tokens == r.usage.input_tokens + 6
    # instructions and input items with text parts: the system message and user messages
    items = [{"role": "user", "content": [{"type": "input_text", "text": PROMPT}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
             {"role": "user", "content": "again"}]  # fmt: skip
    r = client.responses.create(model="m", input=items, instructions="Be brief.", max_output_tokens=5, **GREEDY,
                                extra_body={"ignore_eos": True})  # fmt: skip
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]  # fmt: skip
    c = chat(client, messages, max_tokens=5, extra_body={"ignore_eos": True})
    assert r.output_text == c.choices[0].message.content and r.usage.input_tokens == c.usage.prompt_tokens
    assert r.instructions == "Be brief."


def test_store_retrieve_delete(client):
    r = client.responses.create(model="m", input=PROMPT, max_output_tokens=4, **GREEDY)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(
        model="m",
        input=PROMPT,
        max_output_tokens=4,
        store=False,
        **GREEDY,
        include=["reasoning.encrypted_content"],
    )  # as Codex asks
    assert unstored.output_text == r.output_text and unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model="m", input=PROMPT, max_output_tokens=6, **GREEDY,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    second = client.responses.create(model="m", input="tell me more", previous_response_id=first.id,
                                     max_output_tokens=6, **GREEDY, extra_body={"ignore_eos": True})  # fmt: skip
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "tell me more"}]  # fmt: skip
    c = chat(client, messages, max_tokens=6, extra_body={"ignore_eos": True})
    assert second.output_text == c.choices[0].message.content
    assert second.usage.input_tokens == c.usage.prompt_tokens
    assert second.previous_response_id == first.id
    # the first turn's prompt is in the radix cache
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="x", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id"


def test_stream_events_add_up_to_the_answer(client):
    kw = dict(model="m", input=PROMPT, max_output_tokens=8, **GREEDY, extra_body={"ignore_eos": True})
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # fmt: skip
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 8
    assert final.output[0].id == events[2].item.id == events[-2].item.id
    assert events[2].item.content == [] and events[3].part.text == ""  # announced empty, then its part
    assert client.responses.retrieve(final.id).output_text == text


class Settings(pydantic.BaseModel):
    unit: Literal["celsius", "fahrenheit"]
    metric: bool


def test_parse_json_schema_through_the_grammar(client):
    r = client.responses.parse(model="m", input=PROMPT, text_format=Settings, max_output_tokens=64, **GREEDY)
    assert r.status == "completed" and isinstance(r.output_parsed, Settings)
    with client.responses.stream(model="m", input=PROMPT, text_format=Settings, max_output_tokens=64,
                                 **GREEDY) as stream:  # fmt: skip
        final = stream.get_final_response()
    assert final.output_parsed == r.output_parsed
    obj = client.responses.create(model="m", input=PROMPT, text={"format": {"type": "json_object"}},
                                  max_output_tokens=64, **GREEDY)  # fmt: skip
    assert obj.status == "completed" and isinstance(json.loads(obj.output_text), dict)


def test_function_tool_round_trip(client):
    forced = {"type": "function", "name": "set_units"}
    kw = dict(model="m", tools=[TOOL], tool_choice=forced, parallel_tool_calls=False, max_output_tokens=200)
    r = client.responses.create(input=PROMPT, **kw, **GREEDY)
    (call,) = [i for i in r.output if i.type == "function_call"]
    assert call.name == "set_units" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])
    # streamed: the arguments come as deltas, then done
    events = list(client.responses.create(input=PROMPT, **kw, **GREEDY, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == call.arguments and done.name == "set_units"
    assert events[-1].type == "response.completed"
    # the result goes back as function_call_output after the stored call
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"ok": true}'}
    after = client.responses.create(model="m", input=[output], previous_response_id=r.id, max_output_tokens=4,
                                    **GREEDY, extra_body={"ignore_eos": True})  # fmt: skip
    messages = [
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"ok": true}'},
    ]  # fmt: skip
    c = chat(client, messages, max_tokens=4, extra_body={"ignore_eos": True})
    assert after.usage.input_tokens == c.usage.prompt_tokens
    assert after.output_text == c.choices[0].message.content
    # the same conversation given whole, as items
    items = [{"role": "user", "content": PROMPT},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             output]  # fmt: skip
    whole = client.responses.create(model="m", input=items, max_output_tokens=4, **GREEDY,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert whole.usage.input_tokens == c.usage.prompt_tokens and whole.output_text == after.output_text


def test_background_response_is_cancelled(server, client):
    with children_paused(server):  # nothing is generated until the cancel
        r = client.responses.create(model="m", input=PROMPT, background=True, max_output_tokens=50, **GREEDY)
        assert r.status == "queued" and r.background is True
        assert client.responses.retrieve(r.id).status == "in_progress"
        cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(r.id).status == "cancelled"
    done = client.responses.create(model="m", input=PROMPT, background=True, max_output_tokens=5, **GREEDY,
                                   extra_body={"ignore_eos": True})  # fmt: skip
    while (got := client.responses.retrieve(done.id)).status in ("queued", "in_progress"):
        pass
    assert got.status == "incomplete" and got.usage.output_tokens == 5
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(client.responses.create(model="m", input=PROMPT, max_output_tokens=1).id)


UNSUPPORTED = [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [TOOL, {"type": "file_search", "vector_store_ids": ["vs"]}]}, "tools[1].type"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"include": ["reasoning.encrypted_content", "message.output_text.logprobs"]}, "include[1]"),
    ({"background": True, "store": False}, "background"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"temperature": "hot"}, "temperature"),
]  # fmt: skip


@pytest.mark.parametrize("fields, param", UNSUPPORTED)
def test_unsupported_fields_are_400_naming_them(server, fields, param):
    body = {"model": "m", "input": PROMPT, **fields}
    r = httpx.post(server.base_url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_store_is_bounded_oldest_dropped():
    store = ResponseStore(max_count=3, max_bytes=10_000)
    for i in range(5):
        store.put(StoredResponse({"id": f"r{i}", "output": []}))
    assert [store.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    big = {"id": "big", "output": ["x" * 6000]}
    store.put(StoredResponse(big))
    assert store.get("big") is not None and len(store) <= 3 and store.total_bytes <= 10_000
    store.put(StoredResponse({"id": "bigger", "output": ["x" * 6000]}))  # the other big one goes
    assert store.get("big") is None and store.get("bigger") is not None
    store.put(StoredResponse({"id": "huge", "output": ["x" * 20_000]}))  # alone over the bound
    assert store.get("huge") is None and store.get("bigger") is not None


@pytest.fixture(scope="module")
def reasoning_server(model):
    proc = _serve(model, "reasoning.log", "--reasoning-parser", "deepseek-r1")
    yield proc
    stop_test_server(proc)


def test_reasoning_items(reasoning_server):
    client = openai.OpenAI(base_url=reasoning_server.base_url + "/v1", api_key="none", max_retries=0)
    kw = dict(max_output_tokens=8, extra_body={"ignore_eos": True}, **GREEDY)
    c = chat(client, [{"role": "user", "content": PROMPT}], max_tokens=8, extra_body={"ignore_eos": True})
    r = client.responses.create(model="m", input=PROMPT, **kw)
    reasoning = c.choices[0].message.model_extra["reasoning_content"]
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text == reasoning
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(model="m", input=PROMPT, stream=True, **kw))
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == reasoning
    assert events[-1].response.output[0].type == "reasoning"


# Client libraries that speak the Responses API (skipped where not installed) --------------------


def test_langchain_use_responses_api(server, client):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model="m", base_url=server.base_url + "/v1", api_key="none",
                                      use_responses_api=True, temperature=0, max_tokens=6, max_retries=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    message = llm.invoke(PROMPT)
    direct = client.responses.create(model="m", input=PROMPT, max_output_tokens=6, **GREEDY,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    assert message.text == direct.output_text and message.response_metadata["id"].startswith("resp_")
    streamed = "".join(chunk.text for chunk in llm.stream(PROMPT))
    assert streamed == direct.output_text
    tools_llm = llm.model_copy(update={"max_tokens": 200})
    forced = tools_llm.bind_tools([TOOL], tool_choice="set_units").invoke(PROMPT)
    (call,) = forced.tool_calls
    assert call["name"] == "set_units"
    jsonschema.validate(call["args"], TOOL["parameters"])


def test_litellm_responses(server, client, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import
    litellm = pytest.importorskip("litellm")
    # (LiteLLM raises a max_output_tokens under 16 to 16, OpenAI's minimum)
    r = litellm.responses(model="openai/m", input=PROMPT, api_base=server.base_url + "/v1", api_key="none",
                          max_output_tokens=16, temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    direct = client.responses.create(model="m", input=PROMPT, max_output_tokens=16, **GREEDY,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    text = "".join(part.text for item in r.output if item.type == "message" for part in item.content)
    assert text == direct.output_text and r.usage.output_tokens == 16


def test_a_call_cut_by_max_output_tokens_is_incomplete_with_its_partial_arguments(server, client):
    """A forced call that max_output_tokens cuts inside its arguments: the response and the call
    item are `incomplete` (reason max_output_tokens), the arguments are the text written so far
    (a prefix of the whole call's, never a closed reading such as `{}`), the stream says the same;
    on the chat path, finish_reason `length` and the same partial arguments."""
    forced = {"type": "function", "name": "set_units"}
    kw = dict(model="m", tools=[TOOL], tool_choice=forced, **GREEDY)
    whole = client.responses.create(input=PROMPT, max_output_tokens=200, **kw)
    (full,) = [i for i in whole.output if i.type == "function_call"]
    assert whole.status == "completed" and full.status == "completed"
    cut_args = []
    for budget in range(20, whole.usage.output_tokens, 6):
        r = client.responses.create(input=PROMPT, max_output_tokens=budget, **kw)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        calls = [i for i in r.output if i.type == "function_call"]
        if not calls:  # cut before the call's name was whole
            continue
        (call,) = calls
        assert call.status == "incomplete" and call.name == "set_units" and r.output[-1] == call
        assert full.arguments.startswith(call.arguments)
        cut_args.append(call.arguments)
        events = list(client.responses.create(input=PROMPT, max_output_tokens=budget, stream=True, **kw))
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        (done,) = [
            e for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"
        ]
        assert deltas == done.item.arguments == call.arguments and done.item.status == "incomplete"
        assert events[-1].type == "response.incomplete"
        chat_choice = chat(
            client,
            [{"role": "user", "content": PROMPT}],
            tools=[SETTINGS],
            tool_choice={"type": "function", "function": {"name": "set_units"}},
            max_tokens=budget,
        ).choices[0]
        assert chat_choice.finish_reason == "length"
        assert chat_choice.message.tool_calls[0].function.arguments == call.arguments
    assert any(2 < len(a) < len(full.arguments) for a in cut_args), cut_args  # cuts inside the arguments
    assert_idle_accounting(server)


def test_a_forced_function_is_called_exactly_once(client):
    """A named tool_choice: one call (OpenAI's forced function), with parallel_tool_calls left on."""
    forced = {"type": "function", "name": "set_units"}
    r = client.responses.create(
        input=PROMPT, tools=[TOOL], tool_choice=forced, max_output_tokens=300, **GREEDY
    )
    assert r.status == "completed"
    assert [i.name for i in r.output if i.type == "function_call"] == ["set_units"]
    c = chat(
        client,
        [{"role": "user", "content": PROMPT}],
        tools=[SETTINGS],
        tool_choice={"type": "function", "function": {"name": "set_units"}},
        max_tokens=300,
    ).choices[0]
    assert c.finish_reason == "tool_calls" and [t.function.name for t in c.message.tool_calls] == [
        "set_units"
    ]


def _strict(model, body: dict):
    """The installed openai client's own schema, validated strictly (its client skips validation)."""
    return pydantic.TypeAdapter(model).validate_python(body, strict=True)


def test_every_response_and_event_passes_the_clients_strict_schema(server, client):
    """Every shape a client may get: text, a call, a cut call, a stored response, the stream's
    events; usage carries input_tokens_details.cache_write_tokens (the prompt's tokens the radix
    cache did not hold, which it keeps)."""
    from openai.types.responses import Response, ResponseStreamEvent

    forced = {"type": "function", "name": "set_units"}
    bodies = [
        dict(input=PROMPT, max_output_tokens=6),
        dict(input=PROMPT, max_output_tokens=200, tools=[TOOL], tool_choice=forced),
        dict(input=PROMPT, max_output_tokens=40, tools=[TOOL], tool_choice=forced),
    ]
    for body in bodies:
        raw = client.responses.with_raw_response.create(model="m", **body, **GREEDY).http_response.json()
        r = _strict(Response, raw)
        details = r.usage.input_tokens_details
        assert details.cache_write_tokens == r.usage.input_tokens - details.cached_tokens
        stored = httpx.get(f"{server.base_url}/v1/responses/{r.id}", timeout=30).json()
        assert _strict(Response, stored).id == r.id
        with httpx.stream(
            "POST",
            f"{server.base_url}/v1/responses",
            json={"model": "m", "stream": True, **body, **GREEDY},
            timeout=60,
        ) as resp:
            events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
        for event in events:
            _strict(ResponseStreamEvent, event)
        assert _strict(Response, events[-1]["response"]).usage.input_tokens == r.usage.input_tokens


def test_input_items_are_listed_in_pages(server, client):
    """GET /v1/responses/{id}/input_items (client.responses.input_items.list): the request's own
    input as items with ids, the last first by default, in cursor pages (after, limit, order)."""
    from openai.types.responses import ResponseItemList

    call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "set_units",
        "arguments": '{"unit": "celsius"}',
    }
    given = [
        {"role": "user", "content": PROMPT},
        call,
        {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
        {"role": "user", "content": [{"type": "input_text", "text": "and now?"}]},
    ]
    r = client.responses.create(model="m", input=given, tools=[TOOL], max_output_tokens=3, **GREEDY)
    newest_first = client.responses.input_items.list(r.id)
    assert [i.type for i in newest_first.data] == [
        "message",
        "function_call_output",
        "function_call",
        "message",
    ]
    assert not newest_first.has_more and len({i.id for i in newest_first.data}) == 4
    paged = list(client.responses.input_items.list(r.id, order="asc", limit=1))  # follows `after`
    assert [i.id for i in paged] == [i.id for i in reversed(newest_first.data)]
    first, second = paged[0], paged[1]
    assert first.role == "user" and first.content[0].type == "input_text" and first.content[0].text == PROMPT
    assert (second.call_id, second.name, second.arguments) == ("call_1", "set_units", call["arguments"])
    assert paged[2].output == "ok" and paged[3].content[0].text == "and now?"
    page = client.responses.input_items.list(r.id, order="asc", limit=3)
    assert page.has_more and page.first_id == paged[0].id and page.last_id == paged[2].id
    raw = httpx.get(
        f"{server.base_url}/v1/responses/{r.id}/input_items", params={"limit": 2}, timeout=30
    ).json()
    _strict(ResponseItemList, raw)
    plain = client.responses.create(model="m", input=PROMPT, max_output_tokens=2, **GREEDY)
    (item,) = client.responses.input_items.list(plain.id).data
    assert item.role == "user" and item.content[0].text == PROMPT
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")
    with pytest.raises(openai.BadRequestError, match="limit"):
        client.responses.input_items.list(r.id, limit=0)
    with pytest.raises(openai.BadRequestError, match="after"):
        client.responses.input_items.list(r.id, after="msg_nope")
    assert_idle_accounting(server)
