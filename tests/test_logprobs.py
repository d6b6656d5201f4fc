"""Logprobs as SGLang returns them, against transformers' log-softmax on a tiny random Llama: the
chosen tokens' and the top-N alternatives' for each output token (greedy, and sampled: after
temperature), the prompt's from `logprob_start_len` (across prefill chunks and after a cache hit),
SGLang's `meta_info` shapes on /generate, the official openai client's `logprobs` /
`top_logprobs` / `echo` (chat and completions, streaming and not), the overlap loop equal to the
normal one, and a batch mixing requests with and without logprobs giving the same tokens."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch
from sched_utils import gen_req, make_scheduler, oracle_greedy, random_prompts
from test_engine_utils import build_tiny_model, launch_test_server, load_hf_model, stop_test_server

from radixengine import Engine
from radixengine.managers.io_struct import BatchTokenIDOut

MAX_NEW = 8
TOP = 5
ATOL = 2e-4
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "hello world this is a test " * 4,  # longer than a prefill chunk of 16 tokens
    "numbers 0 1 2 3 and the engine that serves it",
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_llama")))


def _engine(model_path, **kw) -> Engine:
    return Engine(
        model_path=model_path,
        dtype="float32",
        max_total_tokens=8192,
        num_threads=1,
        log_level="warning",
        **kw,
    )


@pytest.fixture(scope="module")
def engines(model_path):
    """The overlap loop on a worker thread with 16-token prefill chunks, and the normal loop
    with whole prefills and 4-token pages."""
    overlap = _engine(model_path, cpu_forward_stream="thread", chunked_prefill_size=16)
    normal = _engine(model_path, disable_overlap_schedule=True, page_size=4)
    yield {"overlap": overlap, "normal": normal}
    overlap.shutdown()
    normal.shutdown()


@pytest.fixture(scope="module", params=["overlap", "normal"])
def engine(request, engines):
    return engines[request.param]


@pytest.fixture(scope="module")
def ref(model_path):
    """transformers' log_softmax(logits / temperature) at every position of a sequence."""
    torch.set_num_threads(1)
    hf = load_hf_model(model_path, dtype=torch.float32)

    def run(ids: list[int], temperature: float = 1.0) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits / temperature, dim=-1)

    return run


@pytest.fixture(scope="module")
def prompts(engines):
    tok = engines["normal"].tokenizer
    return [tok.encode(t) for t in TEXTS]


def assert_top(entries, ref_row: torch.Tensor, k: int) -> None:
    """`entries` ([logprob, id, text] most likely first) are the k most likely tokens of ref_row:
    the same values, and each id's logprob is the one reported (ids equal up to exact ties)."""
    assert len(entries) == k
    values, _ = torch.topk(ref_row, k)
    assert [e[0] for e in entries] == pytest.approx(values.tolist(), abs=ATOL)
    for lp, token_id, _ in entries:
        assert float(ref_row[token_id]) == pytest.approx(lp, abs=ATOL)


def assert_output_logprobs(meta: dict, prompt: list[int], ref_lp: torch.Tensor, k: int) -> None:
    out = meta["output_token_logprobs"]
    assert len(out) == meta["output_token_logprobs_length"] == MAX_NEW
    for pos, (lp, token_id, text) in enumerate(out):
        row = ref_lp[len(prompt) - 1 + pos]
        assert float(row[token_id]) == pytest.approx(lp, abs=ATOL) and text is None
        if k:
            assert_top(meta["output_top_logprobs"][pos], row, k)


def test_greedy_output_top_logprobs_match_transformers(engine, prompts, ref):
    outs = engine.generate(
        input_ids=prompts, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=TOP
    )
    for prompt, out in zip(prompts, outs):
        full = prompt + out["output_ids"]
        ref_lp = ref(full)
        assert out["output_ids"] == ref_lp[len(prompt) - 1 : -1].argmax(-1).tolist()
        meta = out["meta_info"]
        assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
        assert_output_logprobs(meta, prompt, ref_lp, TOP)
        assert [e[1] for e in meta["output_top_logprobs"][0]][0] == out["output_ids"][0]
        assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []


def test_sampled_logprobs_are_after_temperature(engine, prompts, ref):
    """SGLang's convention: log_softmax(logits / temperature), before top-k / top-p."""
    params = {**GREEDY, "temperature": 0.7, "top_k": 20, "sampling_seed": 3}
    out = engine.generate(
        input_ids=prompts[0], sampling_params=params, return_logprob=True, top_logprobs_num=3
    )
    ref_lp = ref(prompts[0] + out["output_ids"], temperature=0.7)
    assert_output_logprobs(out["meta_info"], prompts[0], ref_lp, 3)


@pytest.mark.parametrize("start", [0, 5])
def test_prompt_logprobs_match_transformers(engine, prompts, ref, start):
    prompt = prompts[1]  # several 16-token chunks on the overlap engine
    out = engine.generate(
        input_ids=prompt,
        sampling_params=GREEDY,
        return_logprob=True,
        top_logprobs_num=3,
        logprob_start_len=start,
    )
    meta, ref_lp = out["meta_info"], ref(prompt + out["output_ids"])
    inputs, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert [t for _, t, _ in inputs] == prompt[start:] and len(tops) == len(prompt) - start
    assert inputs[0][0] is None and tops[0] is None  # nothing scores the first one
    for j in range(start + 1, len(prompt)):
        lp, token_id, _ = inputs[j - start]
        assert float(ref_lp[j - 1, token_id]) == pytest.approx(lp, abs=ATOL)
        assert_top(tops[j - start], ref_lp[j - 1], 3)
    assert_output_logprobs(meta, prompt, ref_lp, 3)


def test_prompt_logprobs_after_a_cache_hit(engine, prompts, ref):
    """The prefix cache is used only up to logprob_start_len: the positions after it are
    computed, so no prompt logprob is lost (SGLang's rule)."""
    prompt = prompts[2] + prompts[0]
    engine.generate(input_ids=prompt, sampling_params=GREEDY)  # the whole prompt is cached now
    start = len(prompts[2])
    out = engine.generate(
        input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=start
    )
    meta, ref_lp = out["meta_info"], ref(prompt + out["output_ids"])
    assert 0 < meta["cached_tokens"] <= start
    assert [t for _, t, _ in meta["input_token_logprobs"]] == prompt[start:]
    got = [lp for lp, _, _ in meta["input_token_logprobs"][1:]]
    want = [float(ref_lp[j - 1, prompt[j]]) for j in range(start + 1, len(prompt))]
    assert got == pytest.approx(want, abs=ATOL)
    again = engine.generate(
        input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0
    )
    assert again["meta_info"]["cached_tokens"] == 0 and len(
        again["meta_info"]["input_token_logprobs"]
    ) == len(prompt)


def test_prompt_scoring_without_output(engine, prompts, ref):
    """max_new_tokens 0: only the prompt's logprobs (SGLang's scoring use)."""
    params = {**GREEDY, "max_new_tokens": 0}
    out = engine.generate(
        input_ids=prompts[1], sampling_params=params, return_logprob=True, logprob_start_len=0
    )
    assert out["output_ids"] == [] and out["meta_info"]["output_token_logprobs"] == []
    ref_lp, prompt = ref(prompts[1]), prompts[1]
    got = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]]
    assert got[0] is None
    assert got[1:] == pytest.approx(
        [float(ref_lp[j - 1, prompt[j]]) for j in range(1, len(prompt))], abs=ATOL
    )


def test_overlap_and_normal_loops_agree(engines, prompts):
    kw = dict(sampling_params=GREEDY, return_logprob=True, top_logprobs_num=4, logprob_start_len=0)
    a = engines["overlap"].generate(input_ids=prompts, **kw)
    b = engines["normal"].generate(input_ids=prompts, **kw)
    for x, y in zip(a, b):
        assert x["output_ids"] == y["output_ids"]
        for key in ("output_token_logprobs", "input_token_logprobs"):
            xs, ys = x["meta_info"][key], y["meta_info"][key]
            assert [e[1] for e in xs] == [e[1] for e in ys]
            assert [e[0] for e in xs[1:]] == pytest.approx([e[0] for e in ys[1:]], abs=1e-5)
        for key in ("output_top_logprobs", "input_top_logprobs"):
            xs, ys = x["meta_info"][key][1:], y["meta_info"][key][1:]
            assert [[e[0] for e in p] for p in xs] == [pytest.approx([e[0] for e in p], abs=1e-5) for p in ys]


def test_text_in_logprobs_and_streaming(engine, prompts):
    tok = engine.tokenizer
    kw = dict(sampling_params=GREEDY, return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True)
    out = engine.generate(input_ids=prompts[0], logprob_start_len=0, **kw)
    meta = out["meta_info"]
    for _, token_id, text in meta["output_token_logprobs"] + meta["input_token_logprobs"]:
        assert text == tok.decode([token_id])
    assert all(text == tok.decode([t]) for p in meta["output_top_logprobs"] for _, t, text in p)
    chunks = list(engine.generate(input_ids=prompts[0], stream=True, **kw))
    last = chunks[-1]["meta_info"]
    assert [e[1:] for e in last["output_token_logprobs"]] == [e[1:] for e in meta["output_token_logprobs"]]
    assert [e[0] for e in last["output_token_logprobs"]] == pytest.approx(
        [e[0] for e in meta["output_token_logprobs"]], abs=1e-5
    )
    assert [[e[1:] for e in p] for p in last["output_top_logprobs"]] == [
        [e[1:] for e in p] for p in meta["output_top_logprobs"]
    ]
    lengths = [len(c["meta_info"]["output_token_logprobs"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == MAX_NEW


def test_batch_mixing_logprobs_gives_the_same_tokens(engines, prompts):
    """Requests with and without logprobs (greedy and seeded sampling) in one batch: each gets
    the tokens it gets alone, and only the logprobs it asked for."""
    engine = engines["overlap"]
    sampled = {**GREEDY, "temperature": 0.9, "top_p": 0.9, "sampling_seed": 11}
    alone = [engine.generate(input_ids=p, sampling_params=s) for p in prompts for s in (GREEDY, sampled)]

    asks = [{}, dict(return_logprob=True), dict(return_logprob=True, top_logprobs_num=3, logprob_start_len=0)]
    jobs = [
        (p, s, asks[k % 3]) for k, (p, s) in enumerate((p, s) for p in prompts for s in (GREEDY, sampled))
    ]

    async def together():
        calls = [engine.async_generate(input_ids=p, sampling_params=s, **ask) for p, s, ask in jobs]
        return await asyncio.gather(*calls)

    for a, b, (_, _, ask) in zip(alone, asyncio.run(together()), jobs):
        assert a["output_ids"] == b["output_ids"]
        assert ("output_token_logprobs" in b["meta_info"]) == bool(ask)
        assert ("output_top_logprobs" in b["meta_info"]) == bool(ask.get("top_logprobs_num"))


# Scheduler: chunks, a shared prefix and retraction ---------------------------------------------


def _scheduler_logprobs(overlap: bool, tight: bool) -> dict[str, dict]:
    """Every request's logprob messages joined: prompts sharing a prefix, half asking for
    prompt logprobs from 0 or 10, top 2 throughout; `tight` forces chunks and retraction."""
    pool = dict(max_total_tokens=256, chunked_prefill_size=64, init_new_token_ratio=0.05) if tight else {}
    sched = make_scheduler(overlap=overlap, **pool)
    shared = random_prompts(100, 1, 40, 40)[0][:24]
    prompts = random_prompts(11, 8, 20, 50, shared=[shared])
    reqs = [gen_req(f"lp{i}", p, max_new_tokens=24, ignore_eos=True) for i, p in enumerate(prompts)]
    for i, r in enumerate(reqs):
        r.return_logprob, r.top_logprobs_num, r.logprob_start_len = True, 2, (-1, 0, 10)[i % 3]
    sched.io.put(*reqs)
    sched.run_until_idle()
    assert (sched.stats.num_retracted_reqs > 0) == tight
    joined = {r.rid: {"ids": [], "lps": [], "tops": [], "inputs": [], "prompt": r.input_ids} for r in reqs}
    for msg in sched.io.take_outputs():
        if not isinstance(msg, BatchTokenIDOut):
            continue
        for i, rid in enumerate(msg.rids):
            j = joined[rid]
            j["ids"] += msg.output_ids[i]
            j["lps"] += msg.output_token_logprobs[i]
            j["tops"] += msg.output_top_logprobs_idx[i]
            if msg.input_token_logprobs_val[i] is not None:
                j["inputs"].append((msg.input_token_logprobs_val[i], msg.input_token_logprobs_idx[i]))
    return joined


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_scheduler_logprobs_survive_chunks_and_retraction(overlap):
    tight, roomy = _scheduler_logprobs(overlap, tight=True), _scheduler_logprobs(overlap, tight=False)
    for i, (rid, j) in enumerate(tight.items()):
        start = (-1, 0, 10)[i % 3]
        assert j["ids"] == oracle_greedy(j["prompt"], 24, True) == roomy[rid]["ids"]
        assert len(j["lps"]) == len(j["tops"]) == 24 and all(len(t) == 2 for t in j["tops"])
        assert j["lps"] == pytest.approx(roomy[rid]["lps"], abs=1e-4) and j["tops"] == roomy[rid]["tops"]
        assert len(j["inputs"]) == 1, "the prompt's logprobs come once"
        values, ids = j["inputs"][0]
        if start == -1:
            assert values == [] and ids == []
            continue
        assert ids == j["prompt"][start:] and values[0] is None
        assert values[1:] == pytest.approx(roomy[rid]["inputs"][0][0][1:], abs=1e-4)


# HTTP: /generate and the official openai client ------------------------------------------------


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = launch_test_server(
        model_path, log, ["--dtype", "float32", "--max-total-tokens", "8192", "--num-threads", "1"]
    )
    yield proc
    stop_test_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def model_name(client) -> str:
    return client.models.list().data[0].id


def generate(server, body: dict) -> dict | list:
    r = httpx.post(server.base_url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_meta_info_shapes(server, prompts):
    plain = generate(server, {"input_ids": prompts[0], "sampling_params": GREEDY})
    assert not any("logprob" in key for key in plain["meta_info"])
    only_chosen = generate(
        server, {"input_ids": prompts[0], "sampling_params": GREEDY, "return_logprob": True}
    )
    meta = only_chosen["meta_info"]
    assert meta["input_token_logprobs"] == [] and "output_top_logprobs" not in meta
    assert [e[1] for e in meta["output_token_logprobs"]] == plain["output_ids"]
    body = {
        "input_ids": prompts[0],
        "sampling_params": GREEDY,
        "return_logprob": True,
        "top_logprobs_num": 3,
        "logprob_start_len": 0,
        "return_text_in_logprobs": True,
    }
    meta = generate(server, body)["meta_info"]
    assert meta["input_token_logprobs"][0] == [None, prompts[0][0], meta["input_token_logprobs"][0][2]]
    assert meta["input_top_logprobs"][0] is None
    for lp, token_id, text in meta["output_token_logprobs"] + meta["input_token_logprobs"][1:]:
        assert lp <= 0 and isinstance(token_id, int) and isinstance(text, str)
    for position in meta["output_top_logprobs"] + meta["input_top_logprobs"][1:]:
        assert len(position) == 3 and all(len(e) == 3 and isinstance(e[2], str) for e in position)
    batch = generate(
        server,
        {
            "input_ids": prompts[:2],
            "sampling_params": GREEDY,
            "return_logprob": [True, False],
            "top_logprobs_num": [2, 0],
        },
    )
    assert len(batch[0]["meta_info"]["output_top_logprobs"][0]) == 2
    assert "output_token_logprobs" not in batch[1]["meta_info"]


def test_chat_top_logprobs_match_transformers(client, server, engines, ref):
    messages = [{"role": "user", "content": "Say something about foxes."}]
    kw = dict(
        model=model_name(client),
        messages=messages,
        max_tokens=MAX_NEW,
        temperature=0,
        logprobs=True,
        top_logprobs=4,
    )
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == MAX_NEW
    tok = engines["normal"].tokenizer
    prompt = tok.encode(engines["normal"].apply_chat_template(messages), add_special_tokens=False)
    out_ids = generate(server, {"input_ids": prompt, "sampling_params": GREEDY})["output_ids"]
    ref_lp = ref(prompt + out_ids)
    for pos, entry in enumerate(content):
        row = ref_lp[len(prompt) - 1 + pos]
        assert entry.token == tok.decode([out_ids[pos]]) and entry.bytes == list(entry.token.encode("utf-8"))
        assert entry.logprob == pytest.approx(float(row[out_ids[pos]]), abs=ATOL)
        values, ids = torch.topk(row, 4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=ATOL)
        assert [t.token for t in entry.top_logprobs] == [tok.decode([i]) for i in ids.tolist()]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in content
    ]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)


def test_completions_top_logprobs_match_transformers(client, server, engines, prompts, ref):
    prompt, tok = prompts[2], engines["normal"].tokenizer
    r = client.completions.create(
        model=model_name(client), prompt=prompt, max_tokens=MAX_NEW, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == MAX_NEW
    out_ids = generate(server, {"input_ids": prompt, "sampling_params": GREEDY})["output_ids"]
    ref_lp = ref(prompt + out_ids)
    for pos, value in enumerate(lp.token_logprobs):
        row = ref_lp[len(prompt) - 1 + pos]
        assert float(row[out_ids[pos]]) == pytest.approx(value, abs=ATOL)
        # Keyed by text (OpenAI's shape): tokens with the same text share an entry.
        top = {}
        for value, token_id in zip(*torch.topk(row, 3)):
            top.setdefault(tok.decode([int(token_id)]), []).append(float(value))
        assert set(lp.top_logprobs[pos]) == set(top)
        assert all(any(abs(v - w) < ATOL for w in top[t]) for t, v in lp.top_logprobs[pos].items())
    pieces = list(
        client.completions.create(
            model=model_name(client),
            prompt=prompt,
            max_tokens=MAX_NEW,
            temperature=0,
            logprobs=3,
            stream=True,
        )
    )
    streamed = [x for p in pieces if p.choices for x in p.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-5)
    streamed_tops = [t for p in pieces if p.choices for t in p.choices[0].logprobs.top_logprobs]
    assert [set(t) for t in streamed_tops] == [set(t) for t in lp.top_logprobs]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completions_echo_gives_prompt_logprobs_first(client, prompts, ref, stream):
    prompt = prompts[0]
    kw = dict(model=model_name(client), prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True)
    if stream:
        pieces = [p.choices[0].logprobs for p in client.completions.create(**kw, stream=True) if p.choices]
        tokens = [t for lp in pieces for t in lp.token_logprobs]
        tops = [t for lp in pieces for t in lp.top_logprobs]
        assert len(pieces[0].token_logprobs) > len(prompt)  # the first chunk starts with the prompt's
    else:
        lp = client.completions.create(**kw).choices[0].logprobs
        tokens, tops = lp.token_logprobs, lp.top_logprobs
    assert len(tokens) == len(tops) == len(prompt) + 4
    assert tokens[0] is None and tops[0] is None  # SGLang: the first prompt token is not scored
    ref_lp = ref(prompt)
    want = [float(ref_lp[j - 1, prompt[j]]) for j in range(1, len(prompt))]
    assert tokens[1 : len(prompt)] == pytest.approx(want, abs=ATOL)
    assert all(len(t) <= 2 for t in tops[1:])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completions_max_tokens_0_with_echo_scores_the_prompt(client, prompts, ref, stream):
    """`max_tokens: 0` with `echo` (OpenAI's and vLLM's way to score a prompt): the prompt, its
    logprobs, no new token; without `echo` it stays a 400."""
    prompt = prompts[0]
    kw = dict(model=model_name(client), prompt=prompt, max_tokens=0, temperature=0, logprobs=1, echo=True)
    if stream:
        chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices]
        text = "".join(c.choices[0].text for c in chunks)
        tokens = [t for c in chunks for t in c.choices[0].logprobs.token_logprobs]
        reason = chunks[-1].choices[0].finish_reason
    else:
        r = client.completions.create(**kw)
        text, tokens, reason = (
            r.choices[0].text,
            r.choices[0].logprobs.token_logprobs,
            r.choices[0].finish_reason,
        )
        assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(prompt)
    assert reason == "length" and len(tokens) == len(prompt) and tokens[0] is None
    assert text == client.completions.create(**{**kw, "max_tokens": 1}).choices[0].text[: len(text)]
    ref_lp = ref(prompt)
    assert tokens[1:] == pytest.approx(
        [float(ref_lp[j - 1, prompt[j]]) for j in range(1, len(prompt))], abs=ATOL
    )
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        client.completions.create(**{**kw, "echo": False})
