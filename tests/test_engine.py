"""Engine (scheduler + detokenizer processes over ZMQ) against the transformers greedy oracle on a
tiny random Llama: batch and stream, text, input ids and chat, the radix cache on a second pass,
concurrent async calls, and bad requests that fail alone."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_engine_utils import build_tiny_model, hf_greedy, load_hf_model

from radixengine import Engine
from radixengine.engine import RequestError
from radixengine.managers.io_struct import GenerateReqInput

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "hello world this is a test",
    "Once upon a time there was a small model",
    "héllo wörld, 世界 你好 café",
    "numbers 0 1 2 3 and the engine that serves it",
]
MAX_NEW = 12
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="module")
def engine(model_path):
    engine = Engine(
        model_path=model_path, dtype="float32", max_total_tokens=8192, num_threads=1, log_level="warning"
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_model(model_path):
    torch.set_num_threads(1)
    return load_hf_model(model_path, dtype=torch.float32)


@pytest.fixture(scope="module")
def oracle(engine, hf_model):
    """Greedy continuation (MAX_NEW tokens, EOS not stopping) of each prompt, by transformers."""
    tok = engine.tokenizer
    cache: dict[tuple[int, ...], list[int]] = {}

    def run(ids_list: list[list[int]]) -> list[list[int]]:
        missing = [ids for ids in ids_list if tuple(ids) not in cache]
        for ids, out in zip(missing, hf_greedy(hf_model, missing, MAX_NEW)):
            cache[tuple(ids)] = out
        return [cache[tuple(ids)] for ids in ids_list]

    run.encode = lambda text: tok.encode(text)
    return run


def decode(engine, ids):
    return engine.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def assert_accounting(engine) -> None:
    info = engine.get_server_info()
    assert info["num_running_reqs"] == 0 and info["num_queue_reqs"] == 0
    assert (
        info["available_tokens"] + info["evictable_tokens"] + info["protected_tokens"]
        == info["max_total_tokens"]
    )


def test_unknown_server_arg_is_a_type_error():
    with pytest.raises(TypeError, match="not_a_flag"):
        Engine(model_path="unused", not_a_flag=1)


def test_batch_text_matches_transformers_and_second_pass_hits_cache(engine, oracle):
    assert engine.flush_cache()
    expected = oracle([oracle.encode(p) for p in PROMPTS])
    for attempt in range(2):
        outs = engine.generate(PROMPTS, GREEDY)
        assert [o["output_ids"] for o in outs] == expected
        for o, p, e in zip(outs, PROMPTS, expected):
            meta = o["meta_info"]
            assert o["text"] == decode(engine, e)
            assert meta["prompt_tokens"] == len(oracle.encode(p))
            assert meta["completion_tokens"] == MAX_NEW
            assert meta["finish_reason"] == {"type": "length", "length": MAX_NEW}
            assert meta["e2e_latency"] > 0
            if attempt == 1:  # all but the last prompt token come from the radix cache
                assert meta["cached_tokens"] == meta["prompt_tokens"] - 1
    assert_accounting(engine)


def test_input_ids_single_and_batch(engine, oracle):
    ids = [oracle.encode(p) for p in PROMPTS[:3]]
    expected = oracle(ids)
    one = engine.generate(input_ids=ids[0], sampling_params=GREEDY)
    assert one["output_ids"] == expected[0]
    outs = engine.generate(input_ids=ids, sampling_params=[GREEDY] * 3)
    assert [o["output_ids"] for o in outs] == expected


def test_stream_chunks_add_up(engine, oracle):
    expected = oracle([oracle.encode(PROMPTS[3])])[0]
    chunks = list(engine.generate(PROMPTS[3], GREEDY, stream=True))
    assert len(chunks) > 1
    assert sum((c["output_ids"] for c in chunks), []) == expected
    assert "".join(c["text"] for c in chunks) == decode(engine, expected)
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all("\ufffd" not in c["text"] for c in chunks[:-1]) or "\ufffd" in decode(engine, expected)


def test_chat_messages_use_the_chat_template(engine, oracle):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    out = engine.chat(messages, GREEDY)
    assert out["output_ids"] == oracle([ids])[0]
    assert out["meta_info"]["prompt_tokens"] == len(ids)
    batch = engine.chat([messages, messages[1:]], GREEDY)
    assert batch[0]["output_ids"] == out["output_ids"] and len(batch) == 2


def test_concurrent_async_generate(engine, oracle):
    expected = oracle([oracle.encode(p) for p in PROMPTS])

    async def main():
        return await asyncio.gather(*(engine.async_generate(p, GREEDY) for p in PROMPTS * 2))

    outs = asyncio.run(main())
    assert [o["output_ids"] for o in outs] == expected * 2

    async def stream():
        pieces = []
        async for chunk in await engine.async_generate(PROMPTS[0], GREEDY, stream=True):
            pieces += chunk["output_ids"]
        return pieces

    assert asyncio.run(stream()) == expected[0]


def test_stop_string_trims_the_output(engine, oracle):
    expected = oracle([oracle.encode(PROMPTS[1])])[0]
    full = decode(engine, expected)
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip("\ufffd"), "the greedy text must have a printable middle"
    out = engine.generate(PROMPTS[1], {**GREEDY, "stop": stop})
    assert out["text"] == full[: full.find(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = engine.generate(PROMPTS[1], {**GREEDY, "stop": stop, "no_stop_trim": True})
    assert kept["text"].endswith(stop)
    # Streaming never shows the stop string, not even a part of it that is later cut.
    chunks = [c["text"] for c in engine.generate(PROMPTS[1], {**GREEDY, "stop": stop}, stream=True)]
    assert "".join(chunks) == out["text"]


def test_n_choices_and_logprobs(engine, oracle):
    expected = oracle([oracle.encode(PROMPTS[0])])[0]
    outs = engine.generate(PROMPTS[0], {**GREEDY, "n": 2}, return_logprob=True)
    assert [o["output_ids"] for o in outs] == [expected, expected]
    lps = outs[0]["meta_info"]["output_token_logprobs"]
    assert len(lps) == MAX_NEW and all(lp <= 0 and t == e for (lp, t, _), e in zip(lps, expected))


def test_penalties_and_logit_bias(engine, hf_model, oracle):
    """Through the Engine, greedy tokens equal a transformers loop that applies them by hand; an
    out-of-range value is refused naming the field."""
    from test_penalties import penalised_greedy

    ids = oracle.encode(PROMPTS[1])
    plain = oracle([ids])[0]
    params = dict(
        frequency_penalty=1.2, presence_penalty=-0.3, repetition_penalty=1.5, logit_bias={str(plain[1]): -100}
    )
    expected = penalised_greedy(hf_model, ids, MAX_NEW, **params)
    assert expected != plain
    outs = engine.generate(input_ids=[ids, ids], sampling_params=[{**GREEDY, **params}, GREEDY])
    assert [o["output_ids"] for o in outs] == [expected, plain]
    for bad, field in (
        ({"presence_penalty": 2.1}, "presence_penalty"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ):
        with pytest.raises(RequestError, match=field) as e:
            engine.generate(input_ids=ids, sampling_params={**GREEDY, **bad})
        assert e.value.status_code == 400 and e.value.param == field


def test_bad_request_fails_alone(engine, oracle):
    expected = oracle([oracle.encode(PROMPTS[0])])[0]
    with pytest.raises(RequestError, match="temperature"):
        engine.generate(PROMPTS[0], {"temperature": -1})
    with pytest.raises(RequestError, match="too long"):
        engine.generate(input_ids=[5] * 5000)
    with pytest.raises(RequestError, match="unknown sampling parameter"):
        engine.generate(PROMPTS[0], {"max_new_tokenz": 3})
    outs = engine.generate([PROMPTS[0], ""], [GREEDY, GREEDY])
    assert outs[0]["output_ids"] == expected
    assert "empty" in outs[1]["error"] and outs[1]["meta_info"]["finish_reason"]["type"] == "abort"

    async def both():
        good = engine.async_generate(PROMPTS[0], GREEDY)
        bad = engine.async_generate(input_ids=[10**6], sampling_params=GREEDY)
        return await asyncio.gather(good, bad, return_exceptions=True)

    good, bad = asyncio.run(both())
    assert good["output_ids"] == expected
    assert isinstance(bad, RequestError) and bad.status_code == 400
    assert_accounting(engine)


def test_server_info(engine):
    info = engine.get_server_info()
    assert info["model_path"] and info["dtype"] == "float32"
    for key in ("num_retracted_reqs", "num_preempted_reqs", "num_prefill_tokens", "num_cached_tokens"):
        assert key in info
    assert info["num_cached_tokens"] > 0
    assert_accounting(engine)


def test_rid_of_an_aborted_request_is_refused_until_the_scheduler_finished_it(engine, oracle):
    """A client that gives up and retries at once with the same rid is refused with a clear 400
    (not handed the old request's "aborted" output) while the old one is being aborted; once the
    scheduler's final output for it arrived, the rid is free again, and nothing of the old request
    (ids, text, detokenizer state) leaks into the new one."""
    tm = engine.tokenizer_manager
    long = {"max_new_tokens": 500, "ignore_eos": True}

    async def scenario() -> dict:
        old = tm.generate_request(
            GenerateReqInput(text=PROMPTS[0], sampling_params=long, rid="again", stream=True)
        )
        await old.__anext__()  # it runs
        await old.aclose()  # its client is gone: the abort is sent, the scheduler has not finished it
        retry = tm.generate_request(GenerateReqInput(text=PROMPTS[0], sampling_params=GREEDY, rid="again"))
        with pytest.raises(RequestError) as refused:
            await retry.__anext__()
        assert refused.value.status_code == 400 and refused.value.param == "rid"
        assert "duplicate request id 'again'" in refused.value.message
        while "again" in tm.rid_to_state:  # until the old request's final output arrives
            await asyncio.sleep(0.01)
        new = GenerateReqInput(text=PROMPTS[1], sampling_params=GREEDY, rid="again", stream=True)
        return [out async for out in tm.generate_request(new)]

    outs = asyncio.run_coroutine_threadsafe(scenario(), engine.loop).result(120)
    expected = oracle([oracle.encode(PROMPTS[1])])[0]
    assert (
        outs[-1]["meta_info"]["finish_reason"]["type"] == "length" and outs[-1]["meta_info"]["id"] == "again"
    )
    assert all(out["output_ids"] == expected[: len(out["output_ids"])] for out in outs)
    assert outs[-1]["output_ids"] == expected and outs[-1]["text"] == decode(engine, expected)
    assert_accounting(engine)


@pytest.mark.parametrize("rid", [{"a": 1}, [["a"]], 5])
def test_rid_that_is_not_a_string_is_refused(engine, rid):
    with pytest.raises(RequestError, match="rid must be a string") as e:
        engine.generate(PROMPTS[0], GREEDY, rid=rid)
    assert e.value.param == "rid" and e.value.status_code == 400


def test_the_engine_normalises_its_calls_as_http_generate_does(engine, oracle):
    """One normaliser for every front end: per-prompt lists and SGLang's rid suffixes; a call of a
    bad shape is an ArgumentError, a RequestError naming the field that is also a ValueError."""
    expected = oracle([oracle.encode(p) for p in PROMPTS[:2]])
    outs = engine.generate(PROMPTS[:2], {**GREEDY, "n": 2}, rid=["a", "b"], return_logprob=[True, False])
    assert [o["meta_info"]["id"] for o in outs] == ["a_0", "a_1", "b_0", "b_1"]
    assert [o["output_ids"] for o in outs] == [expected[0]] * 2 + [expected[1]] * 2
    assert ["output_token_logprobs" in o["meta_info"] for o in outs] == [True, True, False, False]
    assert [o["meta_info"]["id"] for o in engine.generate(PROMPTS[0], {**GREEDY, "n": 2}, rid="s")] == [
        "s_0", "s_1"
    ]  # fmt: skip
    for call, param in (
        (lambda: engine.generate(PROMPTS[:2], [GREEDY]), "sampling_params"),
        (lambda: engine.generate(PROMPTS[:2], GREEDY, stream=True), "stream"),
        (lambda: engine.generate(PROMPTS[0], GREEDY, input_ids=[1, 2]), "text"),
        (lambda: engine.generate(PROMPTS[:2], [{**GREEDY, "n": 2}, GREEDY]), "n"),
    ):
        with pytest.raises(ValueError) as e:
            call()
        assert isinstance(e.value, RequestError) and e.value.param == param and e.value.status_code == 400
    with pytest.raises(RequestError, match=r"^text\[1\] must be a string, got None$") as e:
        engine.generate([PROMPTS[0], None], GREEDY)
    assert e.value.param == "text"


def test_bad_logprob_fields_are_refused(engine):
    """A wrong top_logprobs_num or logprob_start_len is a 400 naming the field; 0 / -1 are the
    defaults (no alternatives, no prompt logprobs)."""
    tm = engine.tokenizer_manager

    async def run(**kw):
        obj = GenerateReqInput(text=PROMPTS[0], sampling_params=GREEDY, return_logprob=True, **kw)
        return [out async for out in tm.generate_request(obj)][-1]

    bad = [("top_logprobs_num", -1), ("top_logprobs_num", "3"), ("top_logprobs_num", 10**6)]
    bad += [("logprob_start_len", -2), ("logprob_start_len", 10**4), ("logprob_start_len", 1.5)]
    for name, value in bad:
        with pytest.raises(RequestError, match=name) as e:
            asyncio.run_coroutine_threadsafe(run(**{name: value}), engine.loop).result(60)
        assert e.value.param == name
    out = asyncio.run_coroutine_threadsafe(run(top_logprobs_num=0), engine.loop).result(60)
    assert len(out["meta_info"]["output_token_logprobs"]) == MAX_NEW
    assert out["meta_info"]["input_token_logprobs"] == [] and "output_top_logprobs" not in out["meta_info"]


def test_a_lone_surrogate_is_refused_and_the_engine_keeps_serving(engine, oracle):
    """A string UTF-8 cannot encode (a stop string the scheduler's tokenizer would choke on, a
    prompt) is a RequestError naming the field; the scheduler lives on."""
    for call, param in (
        (lambda: engine.generate(PROMPTS[0], {**GREEDY, "stop": "\ud800"}), "stop"),
        (lambda: engine.generate("a\ud800b", GREEDY), "text"),
        (lambda: engine.chat([{"role": "user", "content": "\udc00"}], GREEDY), "messages[0].content"),
    ):
        with pytest.raises(RequestError, match="surrogate") as e:
            call()
        assert e.value.param == param and e.value.status_code == 400
    assert engine.generate(PROMPTS[0], GREEDY)["output_ids"] == oracle([oracle.encode(PROMPTS[0])])[0]
    assert_accounting(engine)


def test_an_implicit_max_new_tokens_is_clipped_to_the_room_left(engine):
    """SGLang's rule: without max_new_tokens, the default 128 shrinks to what the context leaves
    (a prompt near the context still runs); an explicit max_new_tokens past it is refused."""
    max_req_len = engine.get_server_info()["max_req_len"]
    ids = [5] * (max_req_len - 10)
    out = engine.generate(input_ids=ids, sampling_params={"ignore_eos": True, "temperature": 0})
    assert out["meta_info"]["completion_tokens"] == 10
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    with pytest.raises(RequestError, match="max_new_tokens") as e:
        engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 128})
    assert e.value.param == "max_new_tokens"
    assert_accounting(engine)
