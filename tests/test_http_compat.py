"""A drop-in for SGLang's and OpenAI's clients, against a real server (tiny random Llama, an API
key, a `--chat-template` string and a generation_config.json with sampling defaults): any model
name, the bodies LiteLLM / LangChain / Open WebUI / sglang-router / bench_serving send, SGLang's
operational endpoints, the API key's open probes, `--sampling-defaults` and chat_template_kwargs."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_engine_utils import build_tiny_model, launch_test_server, stop_test_server

API_KEY = "sk-compat"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CONTEXT = 4096  # room for a request that runs long enough to be seen running and aborted
LONG = {"max_new_tokens": 4000, "ignore_eos": True}
# `flavour` comes from chat_template_kwargs; an assistant message last stays open with
# continue_final_message (nothing follows its content).
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if not loop.last or m['role'] != 'assistant' %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{{ flavour | default('') }}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "hello world this is a test"}]
# The model's own defaults: top_k 1 makes every chat request that leaves top_k unset greedy.
GENERATION_CONFIG = {"top_k": 1, "temperature": 0.9}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = build_tiny_model(str(tmp_path_factory.mktemp("tiny_llama")), max_position_embeddings=CONTEXT)
    config_file = f"{path}/generation_config.json"
    with open(config_file) as f:
        config = json.load(f)
    with open(config_file, "w") as f:
        json.dump({**config, **GENERATION_CONFIG}, f)
    return path


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--dtype", "float32", "--max-total-tokens", "16384", "--num-threads", "1", "--api-key", API_KEY,
            "--chat-template", TEMPLATE, "--log-level", "debug", "--enable-metrics"]  # fmt: skip
    proc = launch_test_server(model_path, log, args)
    yield proc
    stop_test_server(proc)


@pytest.fixture(scope="module")
def served_name(server):
    return get(server, "/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def get(server, path: str, **kw) -> httpx.Response:
    return httpx.get(server.base_url + path, headers=AUTH, timeout=60, **kw)


def post(server, path: str, body) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=AUTH, timeout=60)


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of a server-sent event stream, `[DONE]` included as a string."""
    events = []
    for line in response.text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def greedy_chat(server, messages=MESSAGES, max_tokens: int = 6) -> str:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


# Model names ----------------------------------------------------------------------------------


def test_openai_client_with_default_and_served_name(server, served_name, model_path):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    expected = greedy_chat(server)
    for model in ("default", served_name, model_path, "gpt-4o-mini"):
        chat = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        assert chat.model == model and chat.choices[0].message.content == expected
        completion = client.completions.create(model=model, prompt="hello world", max_tokens=3, temperature=0)
        assert completion.model == model and completion.usage.completion_tokens <= 3
    stream = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 6


# Client bodies ------------------------------------------------------------------------------

# What LiteLLM sends for `litellm.completion(model="openai/<name>", messages=...)` with the
# optional params it did not get left as nulls, plus the extra fields a proxy adds.
LITELLM_BODY = {
    "model": "default", "messages": MESSAGES, "temperature": 0, "max_tokens": 6, "ignore_eos": True,
    "n": None, "stop": None, "top_p": None, "presence_penalty": None, "frequency_penalty": None,
    "logit_bias": None, "user": None, "seed": None, "tools": None, "tool_choice": None,
    "response_format": None, "stream": False, "stream_options": None, "logprobs": None,
    "top_logprobs": None, "max_completion_tokens": None, "extra_headers": {"x-litellm": "1"},
    "litellm_call_id": "abc", "drop_params": True,
}  # fmt: skip
# LangChain's ChatOpenAI: content as a list of text parts (joined with a space, as SGLang joins
# them), n and stream set, stream usage asked.
LANGCHAIN_BODY = {
    "model": "default", "stream": False, "n": 1, "temperature": 0.0, "max_tokens": 6, "ignore_eos": True,
    "messages": [{"role": "user", "content": [{"type": "text", "text": "hello world"},
                                              {"type": "text", "text": "this is a test"}]}],
}  # fmt: skip
# Open WebUI: its own metadata on the body and on each message, and an id on the message.
OPEN_WEBUI_BODY = {
    "model": "radixengine", "stream": False, "temperature": 0, "max_tokens": 6, "ignore_eos": True,
    "messages": [{"role": "user", "content": "hello world this is a test", "id": "m1",
                  "metadata": {"_db_id": "7ce1f0b3"}}],
    "metadata": {"chat_id": "c1", "message_id": "m1", "session_id": "s1"}, "params": {}, "features": {},
    "variables": {"{{USER_NAME}}": "x"}, "background_tasks": {"title_generation": True},
}  # fmt: skip


@pytest.mark.parametrize(
    "body", [LITELLM_BODY, LANGCHAIN_BODY, OPEN_WEBUI_BODY], ids=["litellm", "langchain", "open-webui"]
)
def test_client_bodies_with_nulls_extra_fields_and_parts(server, body):
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == greedy_chat(server)
    streamed = post(
        server, "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    events = sse_events(streamed)
    assert streamed.status_code == 200 and events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
    assert text == greedy_chat(server) and events[-2]["usage"]["completion_tokens"] == 6


def test_unknown_fields_are_logged_once_at_debug(server):
    for _ in range(2):
        assert (
            post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "zz_unknown": 1}).status_code
            == 200
        )
    assert server.log.read_text().count("ignoring the unknown field 'zz_unknown'") == 1


# sglang-router's bodies (what it forwards, recorded in front of two replicas) -----------------


def test_router_chat_body(server):
    body = {"messages": MESSAGES, "model": "/tmp/rt/model", "logprobs": False, "max_completion_tokens": 6,
            "stream": False, "temperature": 0.0, "no_stop_trim": False, "ignore_eos": True,
            "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
            "stream_reasoning": True, "return_hidden_states": False}  # fmt: skip
    for stream in (False, True):
        r = post(server, "/v1/chat/completions", {**body, "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            text = "".join(e["choices"][0]["delta"].get("content", "") for e in sse_events(r)[:-1])
        else:
            text = r.json()["choices"][0]["message"]["content"]
        assert text == greedy_chat(server)


def test_router_completions_body(server):
    body = {"model": "/tmp/rt/model", "prompt": "hello world", "max_tokens": 5, "temperature": 0.0,
            "stream": False, "echo": False, "no_stop_trim": False, "ignore_eos": True,
            "skip_special_tokens": True, "return_hidden_states": False}  # fmt: skip
    plain = post(
        server,
        "/v1/completions",
        {"prompt": "hello world", "max_tokens": 5, "temperature": 0, "ignore_eos": True},
    )
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert r.json()["usage"]["completion_tokens"] == 5
    echoed = post(server, "/v1/completions", {**body, "echo": True}).json()["choices"][0]["text"]
    assert echoed == "hello world" + plain.json()["choices"][0]["text"]


ROUTER_GENERATE_EXTRAS = {
    "model": None, "return_text_in_logprobs": False, "log_metrics": True, "return_hidden_states": False,
    "background": False, "no_logs": False, "return_bytes": False, "return_entropy": False,
}  # fmt: skip


@pytest.mark.parametrize("prompt", [{"text": "hello world"}, {"input_ids": [5, 6, 7]}])
def test_router_generate_body(server, prompt):
    params = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}
    plain = post(server, "/generate", {**prompt, "sampling_params": params}).json()
    r = post(
        server, "/generate", {**prompt, **ROUTER_GENERATE_EXTRAS, "sampling_params": params, "stream": False}
    )
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == plain["output_ids"] and len(plain["output_ids"]) == 5
    streamed = post(
        server, "/generate", {**prompt, **ROUTER_GENERATE_EXTRAS, "sampling_params": params, "stream": True}
    )
    assert sse_events(streamed)[-2]["output_ids"] == plain["output_ids"]


@pytest.mark.parametrize(
    "route,body,param",
    [
        ("/generate", {"text": "hi", "return_hidden_states": True}, "return_hidden_states"),
        ("/generate", {"text": "hi", "background": True}, "background"),
        ("/generate", {"text": "hi", "return_bytes": True}, "return_bytes"),
        ("/generate", {"text": "hi", "lora_path": "a"}, "lora_path"),
        (
            "/generate",
            {"text": "hi", "return_logprob": True, "logprob_start_len": 10000},
            "logprob_start_len",
        ),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, "bogus": 1}}, "bogus"),
        ("/v1/completions", {"prompt": "hi", "return_hidden_states": True}, "return_hidden_states"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "regex": "a+("}, "regex"),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "max_completion_tokens": -2},
            "max_completion_tokens",
        ),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 0}, "top_p"),
        ("/v1/chat/completions", {"messages": MESSAGES, "n": "2"}, "n"),
        ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "continue_final_message": True},
            "continue_final_message",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 5000}]}, "messages"),
    ],
)
def test_values_that_cannot_be_honoured_are_400_naming_the_field(server, route, body, param):
    r = post(server, route, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400 and err["message"]


def test_generate_nulls_are_unset(server):
    plain = post(
        server, "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    )
    body = {"text": "hello", "input_ids": None, "rid": None, "stream": None, "priority": None,
            "return_logprob": None, "top_logprobs_num": None, "logprob_start_len": None,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "top_p": None, "n": None, "stop": None}}  # fmt: skip
    r = post(server, "/generate", body)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == plain.json()["output_ids"]


# bench_serving's requests (python/sglang/benchmark/serving.py), checked the way it reads them ---


def _bench_completions_stream_text(r: httpx.Response) -> str:
    text = ""
    for e in sse_events(r):
        if e != "[DONE]" and e["choices"][0]["text"]:  # the bench indexes choices[0] on every chunk
            text += e["choices"][0]["text"]
    return text


@pytest.mark.parametrize("stream", [True, False])
def test_bench_serving_sglang_oai(server, served_name, stream):
    body = {"model": served_name, "prompt": "hello world this is", "best_of": 1, "max_tokens": 8,
            "stream": stream, "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    text = _bench_completions_stream_text(r) if stream else r.json()["choices"][0]["text"]
    assert text and len(text) > 0


@pytest.mark.parametrize("stream", [True, False])
def test_bench_serving_sglang_oai_chat(server, served_name, stream):
    body = {"model": served_name, "messages": [{"role": "user", "content": "hello world"}],
            "max_completion_tokens": 8, "stream": stream, "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    if stream:
        events = [e for e in sse_events(r) if e != "[DONE]"]
        content = "".join(
            (e["choices"][0].get("delta") or {}).get("content") or "" for e in events if e["choices"]
        )
        assert content
    else:
        assert r.json()["choices"][0]["message"]["content"] and r.json()["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("prompt", [{"text": "hello world this is"}, {"input_ids": [5, 6, 7, 8]}])
def test_bench_serving_sglang_generate(server, model_path, prompt):
    body = {**prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
            "stream": True, "lora_path": None, "return_logprob": False, "return_routed_experts": False,
            "logprob_start_len": -1}  # fmt: skip
    r = post(server, "/generate", body)
    assert r.status_code == 200, r.text
    events = [e for e in sse_events(r) if e != "[DONE]"]
    assert events[-1]["meta_info"]["completion_tokens"] == 8 and events[-1]["text"]
    # What the bench asks before and after a run.
    info = get(server, "/model_info").json()
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(info["tokenizer_path"] or info["model_path"])
    server_info = get(server, "/server_info").json()
    assert isinstance(server_info["internal_states"], list) and server_info["internal_states"]
    assert post(server, "/flush_cache", None).status_code == 200


# Operational endpoints -------------------------------------------------------------------------


def test_model_and_server_info_as_the_router_parses_them(server, served_name, model_path):
    for path in ("/model_info", "/get_model_info"):
        info = get(server, path).json()
        assert info["model_path"] == model_path and info["tokenizer_path"] == model_path
        assert info["is_generation"] is True and info["model_type"] == "llama"
        assert info["architectures"] == ["LlamaForCausalLM"]
    for path in ("/server_info", "/get_server_info"):
        info = get(server, path).json()
        assert info["model_path"] == model_path and info["served_model_name"] == served_name
        assert "model" not in info and "model_id" not in info  # the router takes them as aliases
        for name in ("max_total_tokens", "max_prefill_tokens", "max_running_requests", "tp_size", "dp_size"):
            assert isinstance(info[name], int) and info[name] >= 0, name
        assert isinstance(info["version"], str) and info["internal_states"][0]["max_total_tokens"] == 16384
        assert info["default_sampling_params"] == GENERATION_CONFIG


def test_models_and_model_by_id(server, served_name):
    card = get(server, f"/v1/models/{served_name}").json()  # the name is a path: slashes in the URL
    assert card["id"] == served_name and card["max_model_len"] == CONTEXT
    r = get(server, "/v1/models/no-such-model")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    assert client.models.retrieve(served_name).id == served_name


def test_loads_and_get_load(server):
    loads = get(server, "/v1/loads").json()
    load = loads["loads"][0]
    assert load["dp_rank"] == 0 and load["max_total_num_tokens"] == 16384 and load["num_running_reqs"] == 0
    assert loads["aggregate"]["total_tokens"] == load["num_total_tokens"] and isinstance(
        loads["version"], str
    )
    assert set(get(server, "/v1/loads", params={"include": "core"}).json()["loads"][0]) == set(load)
    bad = get(server, "/v1/loads", params={"include": "bogus"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "include"
    text = get(server, "/v1/loads", params={"format": "prometheus"}).text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"sglang_num_running_reqs", "sglang_token_usage", "sglang_num_total_tokens"} <= names
    (legacy,) = get(server, "/get_load").json()
    for name in ("num_reqs", "num_waiting_reqs", "num_tokens", "num_pending_tokens"):
        assert isinstance(legacy[name], int), name


def test_loads_count_a_running_request(server):
    body = {"text": "hello", "rid": "load-probe", "stream": True,
            "sampling_params": LONG}  # fmt: skip
    with httpx.stream("POST", server.base_url + "/generate", json=body, headers=AUTH, timeout=60) as r:
        lines = r.iter_lines()  # kept: dropping the iterator closes the connection
        next(lines)  # running: its first token is out
        load = get(server, "/v1/loads").json()["loads"][0]
        assert load["num_running_reqs"] == 1 and load["num_used_tokens"] > 0
        assert get(server, "/get_load").json()[0]["num_reqs"] == 1
        assert post(server, "/abort_request", {"rid": "load-probe"}).status_code == 200
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    # the stream ends as SGLang's does: a normal chunk whose finish_reason is the abort
    reason = events[-1]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 499, events[-1]
    assert events[-1]["meta_info"]["completion_tokens"] == len(events[-1]["output_ids"]) >= 1
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])


def test_a_generate_stream_failing_mid_way_ends_with_its_abort_chunk(server):
    """A request that fails after its first output (a regex that dead-ends after "a") ends its
    /generate stream as SGLang's does: a normal chunk whose finish_reason is the abort (400);
    one refused before any output gets the HTTP status."""
    body = {"text": "hello", "stream": True, "sampling_params": {"max_new_tokens": 8, "regex": "a[^\\s\\S]"}}
    with httpx.stream("POST", server.base_url + "/generate", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]" and len(events) >= 2 and "error" not in events[-1]
    reason = events[-1]["meta_info"]["finish_reason"]
    assert (
        reason["type"] == "abort"
        and reason["status_code"] == 400
        and "matches no output" in reason["message"]
    )
    refused = {**body, "sampling_params": {"max_new_tokens": 8, "regex": "[^\\s\\S]"}}
    r = post(server, "/generate", refused)
    assert r.status_code == 400 and "matches no output" in r.json()["error"]["message"]


def test_an_aborted_chat_stream_ends_with_an_error_event(server):
    body = {"messages": MESSAGES, "max_tokens": 3500, "ignore_eos": True, "stream": True, "rid": "chat-abort"}
    with httpx.stream(
        "POST", server.base_url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60
    ) as r:
        lines = r.iter_lines()
        next(lines)
        assert post(server, "/abort_request", {"rid": "chat-abort"}).status_code == 200
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == 499  # the OpenAI routes keep OpenAI's error shape


def test_abort_all_ends_a_waiting_non_streaming_request(server):
    result = {}
    body = {"text": "hello", "sampling_params": LONG}

    def run() -> None:
        result["response"] = post(server, "/generate", body)

    thread = threading.Thread(target=run)
    thread.start()
    while get(server, "/v1/loads").json()["loads"][0]["num_running_reqs"] == 0:
        assert thread.is_alive(), result["response"].text
    assert post(server, "/abort_request", {"abort_all": True}).status_code == 200
    thread.join(60)
    # SGLang's answer: the output so far, its finish_reason the abort
    response = result["response"]
    assert response.status_code == 200, response.text
    reason = response.json()["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 499 and "aborted" in reason["message"]
    assert post(server, "/abort_request", {"rid": "nothing-runs-under-this"}).status_code == 200
    bad = post(server, "/abort_request", {})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "rid"


def test_tokenize_and_detokenize(server, tokenizer):
    for prefix in ("", "/v1"):
        r = post(server, prefix + "/tokenize", {"model": "default", "prompt": "hello world"}).json()
        assert r["tokens"] == tokenizer.encode("hello world") and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == CONTEXT
        batch = post(server, prefix + "/tokenize", {"prompt": ["hello", "world test"]}).json()
        assert batch["tokens"] == [tokenizer.encode("hello"), tokenizer.encode("world test")]
        assert batch["count"] == [len(t) for t in batch["tokens"]]
        text = post(server, prefix + "/detokenize", {"tokens": r["tokens"]}).json()["text"]
        assert text == "hello world"
        texts = post(server, prefix + "/detokenize", {"tokens": batch["tokens"]}).json()["text"]
        assert texts == ["hello", "world test"]
    bad = post(server, "/detokenize", {"tokens": [10**7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    bad = post(server, "/tokenize", {"prompt": 5})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


# The chat template, its kwargs and the model's sampling defaults ------------------------------


def render(tokenizer, messages, **kwargs) -> list[int]:
    from jinja2 import Template

    return tokenizer.encode(Template(TEMPLATE).render(messages=messages, **kwargs), add_special_tokens=False)


def test_chat_template_flag_kwargs_and_continue_final_message(server, tokenizer):
    tokens = post(server, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    assert tokens == render(tokenizer, MESSAGES, add_generation_prompt=True)
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello world"}, {"type": "text", "text": "this is a test"}],
        }
    ]
    assert post(server, "/tokenize", {"messages": parts}).json()["tokens"] == tokens
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    bad = post(server, "/tokenize", {"messages": image})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].content[0].type"
    body = {"messages": MESSAGES, "chat_template_kwargs": {"flavour": "Sure"}}
    assert post(server, "/tokenize", body).json()["tokens"] == render(
        tokenizer, MESSAGES, add_generation_prompt=True, flavour="Sure"
    )
    r = post(server, "/v1/chat/completions", {**body, "max_tokens": 1}).json()
    assert r["usage"]["prompt_tokens"] == len(
        render(tokenizer, MESSAGES, add_generation_prompt=True, flavour="Sure")
    )
    partial = MESSAGES + [{"role": "assistant", "content": "The answer is"}]
    expected = render(tokenizer, partial, add_generation_prompt=False)
    assert tokenizer.decode(expected).endswith("The answer is")
    r = post(
        server, "/v1/chat/completions", {"messages": partial, "continue_final_message": True, "max_tokens": 1}
    )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(expected)


def test_chat_takes_the_model_sampling_defaults_when_unset(server):
    """generation_config.json sets top_k 1: a hot temperature stays greedy unless top_k is given."""
    greedy = greedy_chat(server, max_tokens=10)
    hot = {"messages": MESSAGES, "max_tokens": 10, "temperature": 5.0, "ignore_eos": True, "seed": 3}
    assert post(server, "/v1/chat/completions", hot).json()["choices"][0]["message"]["content"] == greedy
    free = post(server, "/v1/chat/completions", {**hot, "top_k": -1}).json()["choices"][0]["message"][
        "content"
    ]
    assert free != greedy


def test_default_model_path_is_the_bundled_model(gguf_path):
    from radixengine.managers.tokenizer_manager import TokenizerManager
    from radixengine.server_args import ServerArgs

    tm = TokenizerManager(ServerArgs(enable_metrics=False), None, {"vocab_size": 10}, tokenizer=object())
    assert tm.model_path == gguf_path
    assert tm.tokenizer_path and __import__("os").path.isfile(f"{tm.tokenizer_path}/config.json")


# The API key ------------------------------------------------------------------------------------


def test_api_key_leaves_probes_open_and_takes_any_bearer_case(server):
    for path in ("/health", "/health_generate", "/metrics"):
        assert httpx.get(server.base_url + path, timeout=60).status_code == 200, path
    for path in ("/v1/models", "/model_info", "/server_info", "/v1/loads", "/get_load"):
        assert httpx.get(server.base_url + path).status_code == 401, path
    for path, body in (("/tokenize", {"prompt": "x"}), ("/abort_request", {"abort_all": True})):
        assert httpx.post(server.base_url + path, json=body).status_code == 401, path
    for header in (f"bearer {API_KEY}", f"BEARER {API_KEY}", f"Bearer  {API_KEY}"):
        assert httpx.get(server.base_url + "/v1/models", headers={"Authorization": header}).status_code == 200
    for header in (API_KEY, f"Basic {API_KEY}", f"Bearer {API_KEY}x", "Bearer"):
        assert httpx.get(server.base_url + "/v1/models", headers={"Authorization": header}).status_code == 401


def test_cors_preflight_is_answered_without_the_key(server):
    """As SGLang's CORSMiddleware: any origin, method and header; a browser's preflight needs no
    key, the request it announces still does, and its answer (a 401 too) names the origin."""
    origin = "http://app.example"
    preflight = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-custom",
    }
    url = server.base_url + "/v1/chat/completions"
    r = httpx.options(url, headers=preflight, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] in ("*", origin)
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "x-custom" in r.headers["access-control-allow-headers"].lower()
    body = {"messages": MESSAGES, "max_tokens": 1}
    r = httpx.post(url, json=body, headers={"Origin": origin}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    assert r.headers["access-control-allow-origin"] in ("*", origin)
    r = httpx.post(url, json=body, headers={**AUTH, "Origin": origin}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] in ("*", origin)


# Error types ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method,path,status,err_type",
    [
        ("GET", "/v1/chat/completions", 405, "MethodNotAllowedError"),
        ("DELETE", "/generate", 405, "MethodNotAllowedError"),
        ("GET", "/v1/nothing-here", 404, "NotFoundError"),
        ("POST", "/nothing-here", 404, "NotFoundError"),
    ],
)
def test_wrong_method_and_unknown_route_error_types(server, method, path, status, err_type):
    r = httpx.request(method, server.base_url + path, headers=AUTH, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (err_type, status, None)
    assert path in error["message"]
    if status == 405:
        assert "POST" in r.headers["allow"]
