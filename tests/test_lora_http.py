"""LoRA through the real server and the openai client: a chat to model=<adapter> (and
"base:adapter"), a /generate batch of two adapters and the base model, /v1/models, load -> use ->
unload -> 400 at run time, and the 400s naming an unknown adapter. Outputs equal transformers +
peft's greedy tokens with the same adapter."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch
from lora_utils import peft_model, save_random_adapter
from test_engine_utils import (
    build_tiny_model,
    hf_greedy,
    launch_test_server,
    load_hf_model,
    stop_test_server,
    wait_for_idle_accounting,
)

MAX_NEW = 8


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_http")
    base = build_tiny_model(str(root / "base"))
    adapters = {
        n: save_random_adapter(Path(base), root / n, seed=s, r=r)
        for n, s, r in (("a", 1, 8), ("b", 2, 4), ("c", 3, 16))
    }
    return base, {n: str(p) for n, p in adapters.items()}


@pytest.fixture(scope="module")
def server(paths, tmp_path_factory):
    base, adapters = paths
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--dtype", "float32", "--max-total-tokens", "4096", "--num-threads", "1"]
    args += ["--lora-paths", f"a={adapters['a']}", f'{{"lora_name": "b", "lora_path": "{adapters["b"]}"}}']
    args += ["--max-loras-per-batch", "2", "--max-lora-rank", "16"]
    proc = launch_test_server(base, log, args)
    yield proc
    stop_test_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def oracle(paths):
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    base, adapters = paths
    models = {None: load_hf_model(base, dtype=torch.float32)}
    tok = AutoTokenizer.from_pretrained(base)

    def run(ids: list[int], adapter: str | None) -> list[int]:
        if adapter not in models:
            models[adapter] = peft_model(Path(base), Path(adapters[adapter]))
        return hf_greedy(models[adapter], [ids], MAX_NEW)[0]

    run.tok = tok
    return run


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


def idle(server) -> None:
    wait_for_idle_accounting(lambda: httpx.get(server.base_url + "/get_server_info", timeout=60).json())


def _generate_body(prompts: list[list[int]], lora_path) -> dict:
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    return {"input_ids": prompts, "sampling_params": params, "lora_path": lora_path}


def test_generate_batch_of_two_adapters_and_the_base(server, oracle):
    prompt = oracle.tok.encode("The same prompt for every adapter", add_special_tokens=False)
    other = oracle.tok.encode("another one", add_special_tokens=False)
    names = ["a", None, "b", "a"]
    prompts = [prompt, prompt, prompt, other]
    r = post(server, "/generate", _generate_body(prompts, names))
    assert r.status_code == 200, r.text
    outs = [o["output_ids"] for o in r.json()]
    assert outs == [oracle(p, n) for p, n in zip(prompts, names)]
    assert len({tuple(o) for o in outs[:3]}) == 3, "the adapters were meant to change the output"
    idle(server)


def test_chat_to_an_adapter_by_model_name(server, client, oracle):
    messages = [{"role": "user", "content": "Hello there"}]
    text = oracle.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = oracle.tok.encode(text, add_special_tokens=False)
    base_name = client.models.list().data[0].id
    for model in ("b", f"{base_name}:b"):
        out = client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True}
        )
        expected = oracle.tok.decode(oracle(ids, "b"), skip_special_tokens=True)
        assert out.choices[0].message.content == expected
    base = client.chat.completions.create(
        model=base_name, messages=messages, max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True}
    )
    assert base.choices[0].message.content == oracle.tok.decode(oracle(ids, None), skip_special_tokens=True)
    idle(server)


def test_models_lists_the_adapters(client, paths):
    models = {m.id: m for m in client.models.list().data}
    assert {"a", "b"} <= set(models)
    assert models["a"].root == paths[1]["a"]


def test_unknown_adapter_is_a_400_naming_it(server, client):
    r = post(server, "/generate", _generate_body([[5, 6, 7]], "nope"))
    assert r.status_code == 400 and "'nope'" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="nope"):
        client.chat.completions.create(model="base:nope", messages=[{"role": "user", "content": "hi"}])


def test_load_use_unload_then_400(server, client, paths, oracle):
    ids = oracle.tok.encode("load me", add_special_tokens=False)
    r = post(server, "/load_lora_adapter", {"lora_name": "c", "lora_path": paths[1]["c"]})
    assert r.status_code == 200 and r.json()["loaded_adapters"]["c"] == paths[1]["c"], r.text
    again = post(server, "/load_lora_adapter", {"lora_name": "c", "lora_path": paths[1]["c"]})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    r = post(server, "/generate", _generate_body([ids], "c"))
    assert r.status_code == 200 and r.json()[0]["output_ids"] == oracle(ids, "c")
    assert "c" in {m.id for m in client.models.list().data}
    r = post(server, "/unload_lora_adapter", {"lora_name": "c"})
    assert r.status_code == 200 and "c" not in r.json()["loaded_adapters"]
    r = post(server, "/generate", _generate_body([ids], "c"))
    assert r.status_code == 400 and "'c' was unloaded" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="'c' was unloaded"):  # not the base model's output
        client.completions.create(model="c", prompt="hi", max_tokens=2)
    assert post(server, "/unload_lora_adapter", {"lora_name": "c"}).status_code == 400
    idle(server)


def test_a_bad_adapter_is_refused_at_run_time(server, tmp_path):
    r = post(server, "/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
    base_name = httpx.get(server.base_url + "/v1/models", timeout=60).json()["data"][0]["id"]
    r = post(server, "/load_lora_adapter", {"lora_name": base_name, "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "as the served model is" in r.json()["error"]["message"]
