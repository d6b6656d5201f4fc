"""Constrained decoding in the scheduler, with a tiny random Llama and its byte-level BPE
tokenizer (vocab 400): every constrained output matches its grammar (regex, JSON schema, EBNF;
xgrammar and llguidance; greedy and seeded sampling), the unconstrained requests of the same
batches get the tokens they get alone, both loops give the same tokens, and retraction, chunked
prefill, the mixed-chunk path, abort and bad grammars keep working."""

from __future__ import annotations

import json
import re
from functools import cache

import jsonschema
import pytest
import torch
from sched_utils import collect
from test_engine_utils import build_tiny_model

from radixengine.managers.io_struct import AbortReq, BatchTokenIDOut, TokenizedGenerateReqInput
from radixengine.managers.scheduler import Scheduler
from radixengine.managers.scheduler_io import InProcessIO
from radixengine.mem_cache.accounting import check_token_accounting
from radixengine.model_executor.tp_worker import TpModelWorker
from radixengine.sampling.sampling_params import SamplingParams
from radixengine.server_args import ServerArgs

REGEX = r"(cat|dog)-[0-9]{2,4}"
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "pet": {"enum": ["cat", "dog"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "pet", "n"],
    "additionalProperties": False,
}
EBNF = 'root ::= ("yes" | "no") " " [0-9] [0-9]?'
PROMPTS = [
    "the cat sat on the mat and then",
    "hello world, this is a longer prompt about dogs and cats and birds",
    "numbers: one two three",
    "a",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("grammar_tiny")))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@cache
def _worker(model_dir: str, max_total_tokens: int) -> TpModelWorker:
    return TpModelWorker(
        ServerArgs(
            model_path=model_dir,
            device="cpu",
            dtype="float32",
            attention_backend="torch_native",
            max_total_tokens=max_total_tokens,
            num_threads=1,
        )
    )


def make_scheduler(
    model_dir, tokenizer, overlap: bool, max_total_tokens: int = 4096, **overrides
) -> Scheduler:
    args = dict(
        model_path=model_dir,
        device="cpu",
        dtype="float32",
        attention_backend="torch_native",
        max_total_tokens=max_total_tokens,
        chunked_prefill_size=-1,
        test_mode=True,
        disable_overlap_schedule=not overlap,
        cpu_forward_stream="thread",
        constrained_json_disable_any_whitespace=True,  # a random model would loop on whitespace
    )
    args.update(overrides)
    worker = _worker(model_dir, max_total_tokens)
    req_pool, allocator = worker.get_memory_pool()
    req_pool.clear()
    allocator.clear()
    return Scheduler(ServerArgs(**args), tp_worker=worker, tokenizer=tokenizer, io=InProcessIO())


def req(tokenizer, rid: str, prompt: str, max_new_tokens: int = 48, **params) -> TokenizedGenerateReqInput:
    params.setdefault("temperature", 0.0)
    return TokenizedGenerateReqInput(
        rid=rid,
        input_text=prompt,
        input_ids=tokenizer.encode(prompt),
        sampling_params=SamplingParams(max_new_tokens=max_new_tokens, **params),
    )


def run(sched: Scheduler, reqs: list) -> dict:
    sched.io.put(*reqs)
    sched.run_until_idle(20_000)
    results = collect(sched.io.take_outputs())
    assert sched.is_idle()
    check_token_accounting(sched.token_to_kv_pool_allocator, sched.tree_cache, sched.req_to_token_pool)
    return results


def text_of(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def constrained_reqs(tokenizer, prefix: str) -> list[TokenizedGenerateReqInput]:
    reqs = []
    for i, prompt in enumerate(PROMPTS):
        reqs.append(req(tokenizer, f"{prefix}-re{i}", prompt, regex=REGEX))
        reqs.append(req(tokenizer, f"{prefix}-js{i}", prompt, json_schema=json.dumps(SCHEMA)))
        reqs.append(req(tokenizer, f"{prefix}-eb{i}", prompt, ebnf=EBNF))
        reqs.append(
            req(tokenizer, f"{prefix}-sr{i}", prompt, regex=REGEX, temperature=1.0, sampling_seed=7 + i)
        )
    return reqs


def free_reqs(tokenizer, prefix: str) -> list[TokenizedGenerateReqInput]:
    return [req(tokenizer, f"{prefix}-free{i}", p, max_new_tokens=24) for i, p in enumerate(PROMPTS)]


def assert_valid(tokenizer, reqs: list, results: dict) -> None:
    eos = tokenizer.eos_token_id
    for r in reqs:
        res = results[r.rid]
        params = r.sampling_params
        if params.grammar_key is None:
            continue
        assert res.finished_reason == {"type": "stop", "matched": eos}, (r.rid, res.finished_reason)
        text = text_of(tokenizer, res.output_ids)
        if params.regex is not None:
            assert re.fullmatch(params.regex, text), (r.rid, text)
        elif params.ebnf is not None:
            assert re.fullmatch(r"(yes|no) [0-9][0-9]?", text), (r.rid, text)
        else:
            jsonschema.validate(json.loads(text), json.loads(params.json_schema))


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_constrained_and_free_requests_in_one_batch_both_loops(model_dir, tokenizer, backend):
    free_alone = run(make_scheduler(model_dir, tokenizer, overlap=False), free_reqs(tokenizer, "x"))
    outputs = {}
    for overlap in (False, True):
        sched = make_scheduler(model_dir, tokenizer, overlap=overlap, grammar_backend=backend)
        reqs = constrained_reqs(tokenizer, "x") + free_reqs(tokenizer, "x")
        results = run(sched, reqs)
        assert_valid(tokenizer, reqs, results)
        for r in free_reqs(tokenizer, "x"):  # the masks leave the other rows of the batch alone
            assert results[r.rid].output_ids == free_alone[r.rid].output_ids, r.rid
        outputs[overlap] = {rid: res.output_ids for rid, res in results.items()}
    assert outputs[False] == outputs[True]


def test_a_grammar_is_compiled_once_and_each_request_has_its_own_matcher(model_dir, tokenizer):
    sched = make_scheduler(model_dir, tokenizer, overlap=False)
    reqs = [
        req(tokenizer, f"n{j}", PROMPTS[1], regex=REGEX, temperature=1.0, sampling_seed=j) for j in range(4)
    ]
    results = run(sched, reqs)
    assert_valid(tokenizer, reqs, results)
    assert list(sched.grammar_manager.backend.cache) == [("regex", REGEX)]
    assert len({tuple(results[r.rid].output_ids) for r in reqs}) > 1  # independent matchers


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_retraction_rebuilds_the_matcher(model_dir, tokenizer, overlap):
    words = " ".join(PROMPTS).split()
    prompts = [" ".join(words[i % 5 :] + words[: i % 7]) for i in range(8)]
    reqs = [
        req(tokenizer, f"rt{i}", p, max_new_tokens=32, regex=r"[0-9]{24,30}") for i, p in enumerate(prompts)
    ]
    roomy = run(make_scheduler(model_dir, tokenizer, overlap=overlap), reqs)
    sched = make_scheduler(
        model_dir,
        tokenizer,
        overlap=overlap,
        max_total_tokens=256,
        chunked_prefill_size=64,
        init_new_token_ratio=0.05,  # an optimistic estimate: admits more than decode can hold
    )
    results = run(sched, reqs)
    assert sched.stats.num_retracted_reqs > 0, "the pool was meant to force retraction"
    assert_valid(tokenizer, reqs, results)
    assert {k: v.output_ids for k, v in results.items()} == {k: v.output_ids for k, v in roomy.items()}


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_chunked_prefill_and_mixed_chunk(model_dir, tokenizer, overlap):
    long_prompt = " ".join(PROMPTS * 3)
    reqs = [req(tokenizer, "long-js", long_prompt, json_schema=json.dumps(SCHEMA))] + constrained_reqs(
        tokenizer, "c"
    )
    whole = run(make_scheduler(model_dir, tokenizer, overlap=overlap), reqs)
    sched = make_scheduler(
        model_dir, tokenizer, overlap=overlap, chunked_prefill_size=16, enable_mixed_chunk=True
    )
    mixed = []
    run_batch = sched.run_batch
    sched.run_batch = lambda b: (mixed.append(b.forward_mode.is_mixed() and b.has_grammar), run_batch(b))[1]
    results = run(sched, reqs)
    assert any(mixed), "a mixed batch with constrained requests was meant to run"
    assert_valid(tokenizer, reqs, results)
    assert {k: v.output_ids for k, v in results.items()} == {k: v.output_ids for k, v in whole.items()}


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_abort_constrained_requests(model_dir, tokenizer, overlap):
    sched = make_scheduler(model_dir, tokenizer, overlap=overlap)
    schema = dict(SCHEMA, title="abort-me")  # not compiled yet: the abort may find it in the grammar queue
    queued = req(tokenizer, "queued", PROMPTS[0], json_schema=json.dumps(schema))
    running = req(tokenizer, "running", PROMPTS[1], max_new_tokens=200, regex=r"[a-z]{100,150}")
    keep = req(tokenizer, "keep", PROMPTS[2], regex=REGEX)
    sched.io.put(queued, AbortReq(rid="queued"), running, keep)
    for _ in range(6):
        sched.process_input_requests(sched.recv_requests())
        sched.run_step()
    sched.io.put(AbortReq(rid="running"))
    sched.run_until_idle(20_000)
    results = collect(sched.io.take_outputs())
    assert results["queued"].finished_reason["type"] == "abort"
    assert results["running"].finished_reason["type"] == "abort"
    assert 0 < len(results["running"].output_ids) < 100
    assert_valid(tokenizer, [keep], results)
    check_token_accounting(sched.token_to_kv_pool_allocator, sched.tree_cache, sched.req_to_token_pool)


def test_a_bad_grammar_that_reaches_the_scheduler_is_a_400_and_the_rest_runs(model_dir, tokenizer):
    sched = make_scheduler(model_dir, tokenizer, overlap=True)
    bad = [
        req(tokenizer, "bad-re", PROMPTS[0], regex="[a-z"),
        req(tokenizer, "bad-js", PROMPTS[0], json_schema='{"type": "nope"}'),
        req(tokenizer, "bad-eb", PROMPTS[0], ebnf="root ::= "),
    ]
    good = req(tokenizer, "good", PROMPTS[1], regex=REGEX)
    results = run(sched, bad + [good])
    for r in bad:
        reason = results[r.rid].finished_reason
        assert reason["type"] == "abort" and reason["status_code"] == 400, reason
        assert r.sampling_params.grammar_key[0] in reason["message"]
    assert_valid(tokenizer, [good], results)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_grammar_that_matches_nothing_is_a_400_and_the_rest_runs(model_dir, tokenizer, backend, overlap):
    """A regex no output can match is a 400 naming the regex: one that allows no first token
    (found once, when it compiles), and one that dead-ends after its first token (xgrammar lets
    "a" start it; llguidance sees at once that nothing can follow). The rest of the batch runs
    as it would alone."""
    free_alone = run(make_scheduler(model_dir, tokenizer, overlap=overlap), free_reqs(tokenizer, "u"))
    sched = make_scheduler(model_dir, tokenizer, overlap=overlap, grammar_backend=backend)
    dead = [
        req(tokenizer, "empty", PROMPTS[0], regex=r"[^\s\S]"),
        req(tokenizer, "dead-end", PROMPTS[1], regex=r"a[^\s\S]"),
    ]
    good = req(tokenizer, "good", PROMPTS[2], regex=REGEX)
    results = run(sched, dead + [good] + free_reqs(tokenizer, "u"))
    for r in dead:
        reason = results[r.rid].finished_reason
        assert reason["type"] == "abort" and reason["status_code"] == 400, (r.rid, reason)
        assert reason["param"] == "regex" and "the regex matches no output" in reason["message"], reason
    if backend == "xgrammar":  # found while decoding: its row had no token to sample
        assert "begins with the 1 token(s) generated" in results["dead-end"].finished_reason["message"]
    assert_valid(tokenizer, [good], results)
    for r in free_reqs(tokenizer, "u"):
        assert results[r.rid].output_ids == free_alone[r.rid].output_ids, r.rid


def test_grammar_backend_none_refuses_constrained_requests(model_dir, tokenizer):
    sched = make_scheduler(model_dir, tokenizer, overlap=False, grammar_backend="none")
    results = run(sched, [req(tokenizer, "c", PROMPTS[0], regex=REGEX), req(tokenizer, "f", PROMPTS[0])])
    reason = results["c"].finished_reason
    assert reason["status_code"] == 400 and "--grammar-backend none" in reason["message"]
    assert results["f"].finished_reason["type"] in ("length", "stop")


class _NoVocabTokenizer:
    """A tokenizer the grammar backend cannot read (no get_vocab)."""

    def __init__(self, tokenizer) -> None:
        self.inner = tokenizer
        self.eos_token_id = tokenizer.eos_token_id

    def decode(self, ids, **kwargs):
        return self.inner.decode(ids, **kwargs)


def test_a_tokenizer_the_backend_cannot_read_fails_only_constrained_requests(model_dir, tokenizer):
    """The backend is built on the first constrained request: a scheduler whose tokenizer it cannot
    use starts and serves free requests; constrained ones get a 400 with the reason."""
    sched = make_scheduler(model_dir, _NoVocabTokenizer(tokenizer), overlap=False)
    results = run(sched, [req(tokenizer, "c", PROMPTS[0], regex=REGEX), req(tokenizer, "f", PROMPTS[0])])
    reason = results["c"].finished_reason
    assert reason["status_code"] == 400 and "cannot use this tokenizer" in reason["message"]
    assert results["f"].finished_reason["type"] in ("length", "stop")


def test_the_mask_goes_after_penalties_and_logprobs_are_of_the_masked_distribution(model_dir, tokenizer):
    """A logit_bias that favours a token the grammar forbids changes nothing; the constrained
    row's logprob is over the allowed tokens only (their probabilities sum to 1)."""
    sched = make_scheduler(model_dir, tokenizer, overlap=False)
    banned = tokenizer.encode("zzz")[0]
    r = req(tokenizer, "lp", PROMPTS[0], regex="(yes|no)", logit_bias={str(banned): 100.0})
    r.return_logprob, r.top_logprobs_num = True, 5
    sched.io.put(r)
    sched.run_until_idle(20_000)
    msgs = sched.io.take_outputs()
    results = collect(msgs)
    assert_valid(tokenizer, [r], results)
    first_top = next(m.output_top_logprobs_val[0][0] for m in msgs if hasattr(m, "output_top_logprobs_val"))
    # Only y, ye, yes, n, no can start "yes" or "no": the top 5 hold all the mass.
    assert abs(sum(torch.tensor(first_top).exp().tolist()) - 1.0) < 1e-3


def test_structural_tag(model_dir, tokenizer):
    """xgrammar's structural tag: the current format (a sequence of a constant and a JSON schema)
    and SGLang's legacy one (a tag whose content is a schema, after its trigger)."""
    seq = {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": "id:"},
                {"type": "json_schema", "json_schema": {"type": "integer", "minimum": 0, "maximum": 99}},
            ],
        },
    }
    legacy = {
        "structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}],
        "triggers": ["<f>"],
    }
    sched = make_scheduler(model_dir, tokenizer, overlap=True)
    reqs = [
        req(tokenizer, "seq", PROMPTS[0], structural_tag=json.dumps(seq)),
        req(tokenizer, "legacy", PROMPTS[1], max_new_tokens=64, structural_tag=json.dumps(legacy)),
    ]
    results = run(sched, reqs)
    assert results["seq"].finished_reason["type"] == "stop"
    assert re.fullmatch(r"id:[0-9]{1,2}", text_of(tokenizer, results["seq"].output_ids))
    text = text_of(tokenizer, results["legacy"].output_ids)
    for body in re.findall(r"<f>(.*?)</f>", text):  # every tag that closed holds an integer
        int(body)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_grammar_complete_before_min_new_tokens_ends_with_stop(model_dir, tokenizer, backend, overlap):
    """A grammar that allows only its end while min_new_tokens still holds EOS back: the request
    ends with stop as its grammar does (it failed with "no finite logits", a 500), its last
    logprob that of the grammar's only token; the rest of the batch runs as it would alone."""
    free_alone = run(make_scheduler(model_dir, tokenizer, overlap=overlap), free_reqs(tokenizer, "u"))
    sched = make_scheduler(model_dir, tokenizer, overlap=overlap, grammar_backend=backend)
    pet = req(tokenizer, "pet", PROMPTS[1], regex="(cat|dog)", min_new_tokens=40)
    pet.return_logprob = True
    short = [req(tokenizer, "yes", PROMPTS[0], regex="yes", min_new_tokens=20), pet]
    sched.io.put(*short, *free_reqs(tokenizer, "u"))
    sched.run_until_idle(20_000)
    outputs = sched.io.take_outputs()
    results = collect(outputs)
    check_token_accounting(sched.token_to_kv_pool_allocator, sched.tree_cache, sched.req_to_token_pool)
    eos = tokenizer.eos_token_id
    for r in short:
        res = results[r.rid]
        assert res.finished_reason == {"type": "stop", "matched": eos}, (r.rid, res.finished_reason)
        assert res.output_ids[-1] == eos
        assert re.fullmatch(r.sampling_params.regex, text_of(tokenizer, res.output_ids)), res.output_ids
    logprobs = [
        lp for msg in outputs if isinstance(msg, BatchTokenIDOut)
        for rid, lps in zip(msg.rids, msg.output_token_logprobs) if rid == "pet" for lp in lps
    ]  # fmt: skip
    assert len(logprobs) == len(results["pet"].output_ids) and logprobs[-1] == pytest.approx(0.0, abs=1e-6)
    for r in free_reqs(tokenizer, "u"):
        assert results[r.rid].output_ids == free_alone[r.rid].output_ids, r.rid


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_speculation_beside_constrained_requests(model_dir, tokenizer, monkeypatch, overlap):
    """With NGRAM speculation, a request with a grammar takes no draft (its verify node is its
    decode step, under its mask; under overlap its sample waits for the masks) while the free
    requests of the same verify batches draft: every output equals the one without speculation."""
    from test_speculative_scheduler import script_drafts

    reqs = constrained_reqs(tokenizer, "sp")[:8] + free_reqs(tokenizer, "sp")
    plain = run(make_scheduler(model_dir, tokenizer, overlap=False), reqs)
    free = {
        tuple(r.input_ids): plain[r.rid].output_ids + [0] * 8
        for r in reqs
        if r.sampling_params.grammar_key is None
    }
    script_drafts(monkeypatch, free)
    sched = make_scheduler(model_dir, tokenizer, overlap=overlap, speculative_algorithm="NGRAM")
    assert sched.enable_overlap == overlap
    spec = run(sched, reqs)
    assert {rid: r.output_ids for rid, r in spec.items()} == {rid: r.output_ids for rid, r in plain.items()}
    assert sched.stats.num_spec_verify_reqs > 0 and sched.stats.avg_spec_accept_length > 2.0
    assert_valid(tokenizer, reqs, spec)
