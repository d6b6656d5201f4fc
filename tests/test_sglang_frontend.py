"""SGLang's frontend language against this server: the `/generate` bodies `RuntimeEndpoint`
sends (`spaces_between_special_tokens`, `stop_regex`, `max_new_tokens: 0` prefix caching, the
prompt-logprob batch of `select`), and, where SGLang's package is importable, an `sgl.function`
program with `gen`, `select`, `fork` and streaming. SGLang's frontend without its server's
dependencies (which pin their own torch): `pip install --no-deps sglang==0.5.23 pybase64 msgspec
ipython traitlets`."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from test_engine_utils import build_tiny_model, launch_test_server, stop_test_server

PROMPT = "the cat sat on the mat and then"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("frontend")
    model = build_tiny_model(str(root / "model"))
    proc = launch_test_server(model, root / "server.log", ["--dtype", "float32", "--num-threads", "1"])
    yield proc
    stop_test_server(proc)


def generate(server, body: dict) -> dict | list:
    r = httpx.post(server.base_url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def gen_body(**params) -> dict:
    """What `RuntimeEndpoint.generate` sends for `sgl.gen(...)` (SGLang 0.5.23)."""
    sampling = {
        "skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 16,
        "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [], "temperature": 0.0,
        "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
        "ignore_eos": True, "regex": None, "json_schema": None,
    }  # fmt: skip
    return {"text": PROMPT, "sampling_params": {**sampling, **params}}


def test_the_frontend_gen_body_is_served(server):
    plain = generate(server, {"text": PROMPT, "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                                  "ignore_eos": True}})  # fmt: skip
    out = generate(server, gen_body())
    assert out["text"] == plain["text"] and out["meta_info"]["finish_reason"]["type"] == "length"
    off = generate(server, gen_body(spaces_between_special_tokens=False))
    assert off["text"] == plain["text"]  # a fast tokenizer has no such option (as in transformers)


def detokenize(server, ids: list[int]) -> str:
    return httpx.post(server.base_url + "/detokenize", json={"tokens": ids}, timeout=60).json()["text"]


def test_stop_regex_ends_the_output_at_its_first_match(server):
    """The output ends with the first token after which the decoded text matches, untrimmed
    (SGLang's), finish_reason naming the pattern; streamed the same."""
    plain = generate(server, gen_body(max_new_tokens=24))
    ids = plain["output_ids"]
    piece = plain["text"][6:9]
    pattern = "".join(f"[{re.escape(c)}]" for c in piece)
    body = gen_body(max_new_tokens=24, stop_regex=[r"\d{7}", pattern])
    out = generate(server, body)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}, out
    k = out["meta_info"]["completion_tokens"]
    assert out["output_ids"] == ids[:k] and out["text"] == detokenize(server, ids[:k])
    assert re.search(pattern, detokenize(server, ids[:k])) and not re.search(
        pattern, detokenize(server, ids[: k - 1])
    )
    events = []
    with httpx.stream("POST", server.base_url + "/generate", json={**body, "stream": True}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["text"] == out["text"]  # cumulative text, as SGLang streams it
    assert all(out["text"].startswith(e["text"]) for e in events)


@pytest.mark.parametrize(
    "stop_regex, error",
    [
        ("[a-", "is not a valid regular expression"),
        ([""], "non-empty"),
        (7, "non-empty"),
        ([["a"]], "non-empty"),
    ],
)
def test_bad_stop_regex_is_a_400(server, stop_regex, error):
    r = httpx.post(server.base_url + "/generate", json=gen_body(stop_regex=stop_regex), timeout=60)
    assert r.status_code == 400 and error in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "stop_regex"


def test_an_sgl_function_program_runs_gen_select_fork_and_streams(server):
    """SGLang's own frontend (`sglang.lang`, importable after `pip install sglang --no-deps` and
    its few light imports) over `RuntimeEndpoint`: gen with stop_regex, select (prompt logprobs of
    a batch with `max_new_tokens: 0`), fork, and a streamed run equal to the whole one."""
    sgl = pytest.importorskip("sglang")

    @sgl.function
    def program(s, question):
        s += "Q: " + question + "\nA:"
        s += sgl.gen("answer", max_tokens=12, stop_regex=r"\d{5}")
        s += " So, a cat? " + sgl.select("yes_no", choices=["yes", "no"])
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f" Idea {i}:" + sgl.gen("idea", max_tokens=6)
        s += forks[0]["idea"] + forks[1]["idea"]

    backend = sgl.RuntimeEndpoint(server.base_url)
    whole = program.run(question=PROMPT, backend=backend, temperature=0)
    assert whole.error() is None, whole.error()
    assert whole["answer"] and whole["yes_no"] in ("yes", "no")
    text = whole.text()
    assert text.startswith("Q: " + PROMPT + "\nA:" + whole["answer"] + " So, a cat? " + whole["yes_no"])
    streamed = program.run(question=PROMPT, backend=backend, temperature=0, stream=True)
    pieces = list(streamed.text_iter())
    assert len(pieces) > 2 and "".join(pieces) == text


def test_stop_regex_on_the_openai_routes(server):
    """SGLang's `stop_regex` extra on /v1/completions and /v1/chat/completions: finish_reason
    `stop`, `matched_stop` the pattern (what SGLang's matched-stop tests read)."""
    plain = generate(server, gen_body(max_new_tokens=24))
    pattern = "".join(f"[{re.escape(c)}]" for c in plain["text"][6:9])
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop_regex": pattern}
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()
    choice = r["choices"][0]
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", pattern), r
    assert plain["text"].startswith(choice["text"]) and re.search(pattern, choice["text"])
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    url = server.base_url + "/v1/chat/completions"
    whole = httpx.post(url, json=chat, timeout=60).json()["choices"][0]["message"]["content"]
    pattern = "".join(f"[{re.escape(c)}]" for c in whole[4:7])
    r = httpx.post(url, json={**chat, "stop_regex": [r"\d{9}", pattern]}, timeout=60).json()
    choice = r["choices"][0]
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", pattern), r
    assert whole.startswith(choice["message"]["content"]) and len(choice["message"]["content"]) < len(whole)
