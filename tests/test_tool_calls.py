"""Tool calls on /v1/chat/completions.

The parsers (SGLang's detectors) on the model formats they read, whole and streamed in chunks cut
at every position; a tiny random Llama served with a Qwen-style template (`--tool-call-parser
qwen25`): a forced call held to the function's schema by the parser's structural tag, its stream
equal to its answer, a conversation with calls and tool results rendered by the template, and
every bad tool definition a 400 naming the field; and (slow) the default SmolLM2 model with no
parser: calls forced by a JSON-schema grammar, read by the JSON-array fallback, through the
official openai client."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from test_engine_utils import build_tiny_model, launch_test_server, stop_test_server

from radixengine.entrypoints.openai_protocol import Tool
from radixengine.function_call.function_call_parser import FunctionCallParser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
TOOLS = [Tool.model_validate(WEATHER), Tool.model_validate(TIME)]
PARIS = '{"city": "Paris", "unit": "celsius"}'

# (parser, model text, text for the user, [(name, arguments)])
FORMATS = [
    (
        "qwen25",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>',
        "Let me check.",
        [("get_weather", PARIS), ("get_time", '{"zone": "Europe/Paris"}')],
    ),
    (
        "qwen25",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "S\\u00e3o \\"Paulo\\"", "unit": "celsius"}}'
        "\n</tool_call>",
        "",
        [("get_weather", '{"city": "São \\"Paulo\\"", "unit": "celsius"}')],
    ),
    ("qwen25", "No call here, only <tool", "No call here, only <tool", []),
    (
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}};'
        '{"name": "get_time", "parameters": {"zone": "CET"}}',
        "",
        [("get_weather", PARIS), ("get_time", '{"zone": "CET"}')],
    ),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Zürich 🌧", "unit": "celsius"}}',
        "",
        [("get_weather", '{"city": "Zürich 🌧", "unit": "celsius"}')],
    ),
    ("llama3", "The weather is fine.", "The weather is fine.", []),
    (
        None,  # the JSON array a grammar forced
        '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "parameters": {"zone": "CET"}}]',
        "",
        [("get_weather", PARIS), ("get_time", '{"zone": "CET"}')],
    ),
    (
        None,
        '[\n  {\n    "name": "get_weather",\n    "parameters": {\n      "city": "Paris",\n      "unit": "celsius"\n'
        "    }\n  }\n]",
        "",
        [("get_weather", PARIS)],
    ),
    (  # a lone surrogate escape: the arguments keep it as the escape, text UTF-8 can encode
        "qwen25",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "\\ud83d \\ud83d\\ude00", "unit": "celsius"}}'
        "\n</tool_call>",
        "",
        [("get_weather", '{"city": "\\ud83d 😀", "unit": "celsius"}')],
    ),
    (
        "llama3",
        '{"name": "get_time", "parameters": {"zone": "\\udc00"}}',
        "",
        [("get_time", '{"zone": "\\udc00"}')],
    ),
    (
        "pythonic",
        '[get_time(zone="\\ud83d")]',
        "",
        [("get_time", '{"zone": "\\ud83d"}')],
    ),
    (
        "pythonic",
        '[get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]',
        "",
        [("get_weather", PARIS), ("get_time", '{"zone": "CET"}')],
    ),
]


def streamed(parser: str | None, chunks: list[str]) -> tuple[str, list[tuple[str, str]], int]:
    """The chunks through the streaming parse: the user's text, the calls put together from
    their pieces (the name first, then argument fragments), and how many fragments came."""
    p = FunctionCallParser(TOOLS, parser)
    text, calls, fragments = "", {}, 0
    for k, chunk in enumerate(chunks):
        normal, items = p.parse_stream_chunk(chunk)
        if k == len(chunks) - 1:
            end_normal, end_items = p.parse_stream_end()
            normal, items = normal + end_normal, items + end_items
        text += normal
        for item in items:
            if item.name:
                assert item.tool_index not in calls
                calls[item.tool_index] = [item.name, item.parameters]
            else:
                calls[item.tool_index][1] += item.parameters
                fragments += 1
    return text, [tuple(calls[i]) for i in sorted(calls)], fragments


@pytest.mark.parametrize("parser, text, normal, calls", FORMATS)
def test_parse_whole_and_streamed_at_every_cut(parser, text, normal, calls):
    got_normal, items = FunctionCallParser(TOOLS, parser).parse_non_stream(text)
    assert (got_normal, [(c.name, c.parameters) for c in items]) == (normal, calls)
    for cut in range(len(text) + 1):
        assert streamed(parser, [text[:cut], text[cut:]])[:2] == (normal, calls), cut
    by_char = streamed(parser, list(text))
    assert by_char[:2] == (normal, calls)
    if calls and parser != "pythonic":  # JSON formats stream the arguments as they come
        assert by_char[2] >= len(calls) + 1


@pytest.mark.parametrize(
    "parser, text",
    [(p, t) for p, t, _, calls in FORMATS if p != "pythonic" and len(calls) == 1 and "\\u" not in t],
)
def test_a_call_cut_short_keeps_its_arguments_text_so_far(parser, text):
    """Cut anywhere (max_tokens), a call whose name is whole has as arguments a prefix of the
    whole call's (the text so far, unclosed: never `{}` nor a closed reading that passes for
    whole arguments), in one go and streamed a character at a time."""
    (full,) = FunctionCallParser(TOOLS, parser).parse_as_stream(text)[1]
    for cut in range(len(text)):
        _, calls = FunctionCallParser(TOOLS, parser).parse_as_stream(text[:cut])
        if calls:
            assert full.parameters.startswith(calls[0].parameters), (cut, calls[0].parameters)
            by_char = streamed(parser, list(text[:cut]))[1]
            assert by_char == [(full.name, calls[0].parameters)], cut


def test_unknown_function_and_python_dict():
    text = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    assert FunctionCallParser(TOOLS, "qwen25").parse_non_stream(text)[1] == []
    assert streamed("qwen25", list(text))[1] == []
    text = "<|python_tag|>{'name': 'get_time', 'parameters': {'zone': 'CET'}}"
    normal, items = FunctionCallParser(TOOLS, "llama3").parse_non_stream(text)
    assert (normal, [(c.name, c.parameters) for c in items]) == ("", [("get_time", '{"zone": "CET"}')])
    assert streamed("llama3", list(text))[:2] == ("", [("get_time", '{"zone": "CET"}')])


# A tiny random Llama with a Qwen2.5-style template --------------------------------------------

QWEN_STYLE_TEMPLATE = """\
{%- if tools %}<|im_start|>system
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{{ m.content }}{% for call in m.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
# Arguments a random model finishes: enums and booleans only.
SETTINGS = {
    "type": "function",
    "function": {
        "name": "set_units",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "metric": {"type": "boolean"}},
            "required": ["unit", "metric"],
        },
    },
}
MESSAGES = [{"role": "user", "content": "hello world this is a test"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    model = build_tiny_model(str(root / "model"))
    template = root / "template.jinja"
    template.write_text(QWEN_STYLE_TEMPLATE)
    args = ["--dtype", "float32", "--num-threads", "1", "--max-total-tokens", "8192",
            "--chat-template", str(template), "--tool-call-parser", "qwen25",
            "--constrained-json-disable-any-whitespace"]  # fmt: skip
    proc = launch_test_server(model, root / "server.log", args)
    proc.model_path = model
    yield proc
    stop_test_server(proc)


@pytest.fixture(scope="module")
def tiny_client(tiny):
    return openai.OpenAI(base_url=tiny.base_url + "/v1", api_key="none", max_retries=0)


def test_forced_call_in_the_parsers_format(tiny_client):
    tools = [SETTINGS, WEATHER]
    choice = {"type": "function", "function": {"name": "set_units"}}
    kwargs = dict(model="m", messages=MESSAGES, tools=tools, tool_choice=choice, temperature=0, max_tokens=200,
                  parallel_tool_calls=False)  # fmt: skip
    r = tiny_client.chat.completions.create(**kwargs)
    choice0 = r.choices[0]
    assert choice0.finish_reason == "tool_calls"
    (call,) = choice0.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "set_units"
    jsonschema.validate(json.loads(call.function.arguments), SETTINGS["function"]["parameters"])
    assert choice0.message.content == ""

    chunks = list(tiny_client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    pieces = [tc for d in deltas for tc in d.tool_calls or []]
    assert pieces[0].id and pieces[0].function.name == "set_units" and pieces[0].function.arguments == ""
    assert all(p.id is None and p.function.name is None for p in pieces[1:])
    assert "".join(p.function.arguments for p in pieces) == call.function.arguments
    assert "".join(d.content or "" for d in deltas) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_choice_required_and_none(tiny_client):
    r = tiny_client.chat.completions.create(
        model="m", messages=MESSAGES, tools=[SETTINGS], tool_choice="required", temperature=0, max_tokens=200
    )
    calls = r.choices[0].message.tool_calls
    assert calls and all(c.function.name == "set_units" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SETTINGS["function"]["parameters"])
    plain = tiny_client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=12)
    r = tiny_client.chat.completions.create(
        model="m", messages=MESSAGES, tools=[SETTINGS], tool_choice="none", temperature=0, max_tokens=12
    )
    # `none`: no call, and the template is not shown the tools: the answer without tools
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens


def test_conversation_with_calls_and_results_goes_through_the_template(tiny, tiny_client):
    from transformers import AutoTokenizer

    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]  # fmt: skip
    r = tiny_client.chat.completions.create(model="m", messages=messages, tools=[WEATHER], max_tokens=4)
    tok = AutoTokenizer.from_pretrained(tiny.model_path)
    rendered = [dict(m) for m in messages]
    rendered[1] = {**rendered[1], "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.loads(PARIS)}},
    ]}  # fmt: skip
    prompt = tok.apply_chat_template(
        rendered,
        tools=[WEATHER],
        chat_template=QWEN_STYLE_TEMPLATE,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in prompt
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in prompt
    assert r.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))


def test_a_lone_surrogate_escape_in_arguments_is_kept_as_the_escape(tiny, tiny_client):
    """Valid JSON text whose string holds a lone UTF-16 surrogate (`\\ud83d`) gives Python a
    string UTF-8 cannot encode: the answer and the stream keep it as the escape (no 500, no broken
    stream)."""
    model_text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "\\ud83d"}}\n</tool_call>'
    kwargs = dict(model="m", messages=MESSAGES, tools=[TIME], temperature=0, max_tokens=300,
                  extra_body={"regex": re.escape(model_text)})  # fmt: skip
    r = tiny_client.chat.completions.create(**kwargs)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.arguments == '{"zone": "\\ud83d"}'
    assert json.loads(call.function.arguments) == {"zone": "\ud83d"}
    chunks = list(tiny_client.chat.completions.create(**kwargs, stream=True))
    pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert "".join(p.function.arguments for p in pieces) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "noon"}]  # fmt: skip
    # a prompt cannot hold it: sent back, the call is a 400 naming the field, as any such input
    with pytest.raises(openai.BadRequestError, match="lone UTF-16 surrogate") as e:
        tiny_client.chat.completions.create(model="m", messages=history, tools=[TIME], max_tokens=2)
    assert e.value.body["param"] == "messages[1].tool_calls[0].function.arguments.zone"


def _bad(tools=None, **fields) -> dict:
    body = {"messages": MESSAGES, "max_tokens": 1, **fields}
    if tools is not None:
        body["tools"] = tools
    return body


def _weather(**function) -> dict:
    return {"type": "function", "function": {**WEATHER["function"], **function}}


BAD_REQUESTS = [
    (_bad([{"type": "retrieval", "function": WEATHER["function"]}]), "tools[0].type"),
    (_bad([{"type": "function", "function": {"parameters": {}}}]), "tools[0].function.name"),
    (_bad([_weather(name="get weather!")]), "tools[0].function.name"),
    (_bad([WEATHER, _weather()]), "tools[1].function.name"),
    (_bad([_weather(parameters={"type": "object", "properties": {"city": {"type": "strin"}}})]),
     "tools[0].function.parameters"),
    (_bad([_weather(parameters={"type": "array"})]), "tools[0].function.parameters"),
    (_bad([_weather(parameters=["city"])]), "tools[0].function.parameters"),
    (_bad([WEATHER], tool_choice="always"), "tool_choice"),
    (_bad(tool_choice="required"), "tool_choice"),
    (_bad([WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}), "tool_choice.function.name"),
    (_bad([WEATHER], tool_choice={"type": "function"}), "tool_choice.function"),
    (_bad([WEATHER], tool_choice="required", regex="[a-z]+"), "tool_choice"),
    (_bad(messages=[*MESSAGES, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{city"}}]}]),
     "messages[1].tool_calls[0].function.arguments"),
]  # fmt: skip


@pytest.mark.parametrize("body, param", BAD_REQUESTS)
def test_bad_tools_are_400_naming_the_field(tiny, body, param):
    r = httpx.post(tiny.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == 400, error
    assert httpx.get(tiny.base_url + "/health", timeout=10).status_code == 200


# The default model (SmolLM2-135M-Instruct), no --tool-call-parser ----------------------------

QUESTION = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def smol_server(gguf_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("smol_tools") / "server.log"
    proc = launch_test_server(gguf_path, log, ["--num-threads", "1"])
    yield proc
    stop_test_server(proc)


@pytest.fixture(scope="module")
def smol(smol_server):
    return openai.OpenAI(base_url=smol_server.base_url + "/v1", api_key="none", max_retries=0)


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


@pytest.mark.slow
def test_smollm2_forced_calls_validate(smol):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for choice, parallel in (
        ("required", True),
        ({"type": "function", "function": {"name": "get_time"}}, False),
    ):
        kwargs = dict(model="m", messages=QUESTION, tools=[WEATHER, TIME], tool_choice=choice,
                      parallel_tool_calls=parallel, temperature=0, max_tokens=96)  # fmt: skip
        r = smol.chat.completions.create(**kwargs)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and message.content == ""
        assert message.tool_calls and all(c.id.startswith("call_") for c in message.tool_calls)
        for name, arguments in _calls(message):
            jsonschema.validate(json.loads(arguments), schemas[name])
        if isinstance(choice, dict):
            assert [name for name, _ in _calls(message)] == ["get_time"]

        calls: dict[int, list[str]] = {}
        finish = None
        for chunk in smol.chat.completions.create(**kwargs, stream=True):
            delta = chunk.choices[0].delta
            assert not delta.content
            for piece in delta.tool_calls or []:
                if piece.id:
                    calls[piece.index] = [piece.function.name, piece.function.arguments]
                else:
                    calls[piece.index][1] += piece.function.arguments
            finish = chunk.choices[0].finish_reason or finish
        assert [tuple(calls[i]) for i in sorted(calls)] == _calls(message)
        assert finish == "tool_calls"


@pytest.mark.slow
def test_smollm2_tool_choice_none_and_tool_results(smol):
    r = smol.chat.completions.create(
        model="m", messages=QUESTION, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=24
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content.strip()
    forced = smol.chat.completions.create(
        model="m", messages=QUESTION, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=96,
        parallel_tool_calls=False,
    )  # fmt: skip
    call = forced.choices[0].message.tool_calls[0]
    conversation = [
        *QUESTION,
        forced.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    r = smol.chat.completions.create(
        model="m", messages=conversation, tools=[WEATHER], temperature=0, max_tokens=24
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content.strip()
    assert r.usage.prompt_tokens > forced.usage.prompt_tokens


DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def doc_example(language: str) -> str:
    """The code block of `language` after the tool-call example marker of docs/api.md."""
    text = DOC.read_text().split("<!-- tool-call example -->", 1)[1]
    return re.search(rf"```{language}\n(.*?)```", text, re.S).group(1)


@pytest.mark.slow
def test_docs_tool_call_example_runs(smol_server):
    url = smol_server.base_url
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(doc_example("python").replace("http://localhost:30000", url), {})
    first, second = out.getvalue().splitlines()[:2]
    assert re.fullmatch(r"tool_calls get_weather \{'city': '[^']*', 'unit': '(celsius|fahrenheit)'\}", first)
    assert second.strip()
    curl = doc_example("bash").replace("http://localhost:30000", url)
    body = json.loads(subprocess.run(["bash", "-c", curl], capture_output=True, text=True, check=True).stdout)
    call = body["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])


@pytest.mark.parametrize("backend, kind", [("xgrammar", "structural_tag"), ("llguidance", "json_schema")])
def test_forced_call_grammar_follows_the_backend(backend, kind):
    """A backend without structural tags (llguidance) forces the JSON array instead, and the
    answer is read as one."""
    from types import SimpleNamespace

    from radixengine.entrypoints import openai_serving as oai
    from radixengine.entrypoints.chat_tools import add_tool_params
    from radixengine.entrypoints.openai_protocol import ChatCompletionRequest
    from radixengine.server_args import ServerArgs

    checked = []
    args = ServerArgs(model_path="unused", device="cpu", tool_call_parser="qwen25", grammar_backend=backend)
    tm = SimpleNamespace(server_args=args, check_grammar=lambda *a: checked.append(a))
    req = ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required"}
    )
    params = {}
    add_tool_params(tm, req, params)
    assert list(params) == ["skip_special_tokens", kind] and checked == [(kind, params[kind], "tools")]
    text = {
        "structural_tag": f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>',
        "json_schema": f'[{{"name": "get_weather", "parameters": {PARIS}}}]',
    }[kind]
    req.model = "m"
    meta = {"finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 1, "cached_tokens": 0,
            "completion_tokens": 1}  # fmt: skip
    choice = oai.chat_response(tm, req, [{"text": text, "output_ids": [1], "meta_info": meta}])["choices"][0]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [
        ("get_weather", PARIS)
    ]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == ""


def _tool(name: str, parameters: dict) -> Tool:
    return Tool.model_validate({"type": "function", "function": {"name": name, "parameters": parameters}})


# (tools, the forced function or None, valid calls, invalid calls): parameters with local refs of
# every kind, which the array schema must keep meaning what they mean at the tool's root.
REF_CASES = {
    "draft-07 definitions": (
        [_tool("set_unit", {"type": "object", "definitions": {"Unit": {"enum": ["c", "f"]}},
                            "properties": {"unit": {"$ref": "#/definitions/Unit"}}, "required": ["unit"]})],
        "set_unit", [{"unit": "c"}], [{"unit": "k"}],
    ),
    "#/properties ref": (
        [_tool("pair", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}},
                        "required": ["a", "b"]})],
        None, [{"a": 1, "b": 2}], [{"a": 1, "b": "x"}],
    ),
    "root ref": (
        [_tool("tree", {"type": "object", "properties": {"v": {"type": "integer"},
                                                         "kids": {"type": "array", "items": {"$ref": "#"}}},
                        "required": ["v"], "additionalProperties": False})],
        "tree", [{"v": 1, "kids": [{"v": 2, "kids": []}]}], [{"v": 1, "kids": [[{"name": "tree"}]]}],
    ),
    "$defs of one name in two tools": (
        [_tool("ints", {"type": "object", "$defs": {"Item": {"type": "integer"}},
                        "properties": {"x": {"$ref": "#/$defs/Item"}}, "required": ["x"]}),
         _tool("strs", {"type": "object", "$defs": {"Item": {"type": "string"}},
                        "properties": {"x": {"$ref": "#/$defs/Item"}}, "required": ["x"]})],
        None, [{"x": 1}, {"x": "a"}], [{"x": [1]}],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REF_CASES))
def test_forced_calls_keep_local_refs_meaning_what_they_mean(case):
    """The JSON array that forces calls holds each tool's parameters whole in its `$defs`, every
    local ref rebased: `definitions`, `#/properties/...`, `#` and clashing `$defs` names mean what
    they mean at the tool's root (the schema the tool was validated against), and both grammar
    backends compile it."""
    import xgrammar as xgr
    from jsonschema import Draft202012Validator

    from radixengine.constrained import llguidance_backend
    from radixengine.function_call.schema_constraint import json_array_schema

    tools, forced, valid, invalid = REF_CASES[case]
    schema = json_array_schema(tools, forced, parallel_tool_calls=False)
    validator = Draft202012Validator(schema)
    for arguments in valid + invalid:
        names = [
            t.function.name for t in tools if Draft202012Validator(t.function.parameters).is_valid(arguments)
        ]
        assert bool(names) == (arguments in valid), (case, arguments)
        for name in names:
            assert validator.is_valid([{"name": name, "parameters": arguments}]), (case, arguments)
        for tool in tools:
            if tool.function.name not in names:
                assert not validator.is_valid([{"name": tool.function.name, "parameters": arguments}])
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    name = forced or tools[0].function.name
    accepts = xgr.testing._is_grammar_accept_string  # xgrammar's own test helper
    first = next(a for a in valid if Draft202012Validator(tools[0].function.parameters).is_valid(a))
    assert accepts(grammar, json.dumps([{"name": name, "parameters": first}]))
    assert not accepts(grammar, json.dumps([{"name": name, "parameters": invalid[0]}]))
    llguidance_backend.validate("json_schema", json.dumps(schema))
