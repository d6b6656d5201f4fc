"""LoRA through the scheduler: every request of a batch mixing adapters and the base model gets
transformers + peft's greedy tokens and logprobs with its adapter (overlap on and off, page 1
and 16, chunked prefill, forced retraction); adapters never share KV; a batch holds at most
--max-loras-per-batch adapters; an unknown adapter is a 400."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path

import pytest
from lora_utils import greedy_reference, peft_model, save_random_adapter
from sched_utils import EOS, _hf_model, assert_no_leak, gen_req, random_prompts, tiny_model_dir

from radixengine.lora.lora_registry import parse_lora_paths
from radixengine.managers.io_struct import BatchTokenIDOut, LoadLoRAAdapterReqInput, LoRAAdapterReqOutput
from radixengine.managers.scheduler import Scheduler
from radixengine.managers.scheduler_io import InProcessIO
from radixengine.model_executor.forward_batch_info import ForwardMode
from radixengine.model_executor.tp_worker import TpModelWorker
from radixengine.server_args import ServerArgs

ADAPTERS = {"a": dict(seed=11, r=8), "b": dict(seed=12, r=4, use_rslora=True), "c": dict(seed=13, r=16)}
SHARED = random_prompts(200, 1, 30, 30)[0]


@cache
def adapter_dirs() -> dict[str, str]:
    root = Path(tempfile.mkdtemp(prefix="radixengine-lora-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return {n: str(save_random_adapter(Path(tiny_model_dir()), root / n, **kw)) for n, kw in ADAPTERS.items()}


@cache
def _peft(name: str):
    return peft_model(Path(tiny_model_dir()), Path(adapter_dirs()[name]))


_REF: dict[tuple, tuple[list[int], list[float]]] = {}


def reference(name: str | None, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens (up to EOS) and their logprobs of transformers (+ peft with adapter `name`)."""
    key = (name, tuple(prompt), steps)
    if key not in _REF:
        model = _hf_model() if name is None else _peft(name)
        tokens, logprobs = greedy_reference(model, prompt, steps)
        if EOS in tokens:
            end = tokens.index(EOS) + 1
            tokens, logprobs = tokens[:end], logprobs[:end]
        _REF[key] = (tokens, logprobs)
    return _REF[key]


@cache
def _worker(page_size: int, max_total_tokens: int, max_loras_per_batch: int) -> TpModelWorker:
    return TpModelWorker(_args(page_size, max_total_tokens, max_loras_per_batch))


def _args(page_size, max_total_tokens, max_loras_per_batch, **overrides) -> ServerArgs:
    args = dict(
        model_path=tiny_model_dir(),
        device="cpu",
        dtype="float32",
        attention_backend="torch_native",
        page_size=page_size,
        max_total_tokens=max_total_tokens,
        num_threads=1,
        lora_paths=[f"{n}={p}" for n, p in adapter_dirs().items()],
        max_loras_per_batch=max_loras_per_batch,
        test_mode=True,
        cpu_forward_stream="thread",
    )
    args.update(overrides)
    return ServerArgs(**args)


def make_lora_scheduler(
    page_size=1, max_total_tokens=4096, max_loras_per_batch=4, overlap=False, **overrides
) -> Scheduler:
    worker = _worker(page_size, max_total_tokens, max_loras_per_batch)
    req_pool, allocator = worker.get_memory_pool()
    req_pool.clear()
    allocator.clear()
    args = _args(
        page_size, max_total_tokens, max_loras_per_batch, disable_overlap_schedule=not overlap, **overrides
    )
    return Scheduler(args, tp_worker=worker, io=InProcessIO())


def lora_ids() -> dict[str, str]:
    return {r.lora_name: r.lora_id for r in parse_lora_paths([f"{n}={p}" for n, p in adapter_dirs().items()])}


def lora_req(rid: str, prompt: list[int], name: str | None, max_new_tokens: int = 12, logprobs: bool = True):
    req = gen_req(rid, prompt, max_new_tokens=max_new_tokens)
    req.lora_id = None if name is None else lora_ids()[name]
    req.return_logprob = logprobs
    return req


def run(sched: Scheduler, reqs: list) -> dict[str, dict]:
    sched.io.put(*reqs)
    sched.run_until_idle()
    out: dict[str, dict] = {}
    for msg in sched.io.take_outputs():
        if not isinstance(msg, BatchTokenIDOut):
            continue
        for i, rid in enumerate(msg.rids):
            r = out.setdefault(rid, {"ids": [], "logprobs": [], "cached": 0, "finish": None})
            r["ids"] += msg.output_ids[i]
            if msg.output_token_logprobs:
                r["logprobs"] += msg.output_token_logprobs[i] or []
            r["cached"] = msg.cached_tokens[i]
            r["finish"] = msg.finished_reasons[i]
    assert_no_leak(sched)
    return out


def assert_matches_peft(reqs, names: dict[str, str | None], out) -> None:
    for r in reqs:
        tokens, logprobs = reference(names[r.rid], r.input_ids, r.sampling_params.max_new_tokens)
        assert out[r.rid]["ids"] == tokens, f"{r.rid} ({names[r.rid]}): tokens differ from peft"
        if r.return_logprob:
            assert out[r.rid]["logprobs"] == pytest.approx(logprobs, abs=2e-4), f"{r.rid}: logprobs"


def mixed_workload(tag: str, long: bool = False, logprobs: bool = True):
    prompts = random_prompts(31, 18, 5, 25) + (
        [SHARED + p for p in random_prompts(32, 2, 60, 70)] if long else []
    )
    names = [None, "a", "b", "c"]
    reqs, which = [], {}
    for i, p in enumerate(prompts):
        rid = f"{tag}{i}"
        which[rid] = names[i % 4]
        reqs.append(lora_req(rid, p, which[rid], logprobs=logprobs))
    for name in names:  # one prompt under every adapter and the base model at once
        rid = f"{tag}s{name}"
        which[rid] = name
        reqs.append(lora_req(rid, SHARED, name, logprobs=logprobs))
    return reqs, which


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("chunk", [16, -1])
@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_adapters_match_peft(page_size, chunk, overlap, monkeypatch):
    from radixengine.lora import lora_manager

    forms = []
    build = lora_manager.LoRABatchInfo.build

    def spy(*args, **kwargs):
        info = build(*args, **kwargs)
        forms.append("masked" if info.scattered else "runs")
        return info

    monkeypatch.setattr(lora_manager.LoRABatchInfo, "build", spy)
    sched = make_lora_scheduler(page_size, overlap=overlap, chunked_prefill_size=chunk)
    reqs, which = mixed_workload("m", long=True)
    out = run(sched, reqs)
    assert "masked" in forms, "the batches must interleave adapters (the torch form masks them)"
    assert_matches_peft(reqs, which, out)
    # The adapters change the tokens (else this test could not tell them apart).
    assert len({tuple(out[f"ms{n}"]["ids"]) for n in (None, "a", "b", "c")}) == 4


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_mixed_chunk_with_adapters_matches_peft(overlap):
    """--enable-mixed-chunk: the running requests' decode rides in the prefill batch, each row
    with its own adapter."""
    sched = make_lora_scheduler(overlap=overlap, chunked_prefill_size=16, enable_mixed_chunk=True)
    modes = []
    forward = sched.tp_worker.forward_batch_generation

    def spy(mwb, *args, **kwargs):
        modes.append((mwb.forward_mode, len({i for i in mwb.lora_ids or [] if i})))
        return forward(mwb, *args, **kwargs)

    sched.tp_worker.forward_batch_generation = spy
    try:
        reqs, which = mixed_workload("mc", long=True, logprobs=False)  # mixed chunks run without logprobs
        sched.io.put(*reqs[:4])
        for _ in range(3):
            sched.process_input_requests(sched.recv_requests())
            sched.run_step()
        out = run(sched, reqs[4:])
    finally:
        del sched.tp_worker.forward_batch_generation
    assert any(mode == ForwardMode.MIXED and n >= 2 for mode, n in modes), "no mixed batch of adapters ran"
    assert_matches_peft(reqs, which, out)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_retraction_with_adapters_keeps_tokens(page_size, overlap):
    sched = make_lora_scheduler(
        page_size, max_total_tokens=320, overlap=overlap, chunked_prefill_size=64, init_new_token_ratio=0.05
    )
    prompts = random_prompts(41, 8, 20, 40, shared=[SHARED[:24]])
    names = [None, "a", "b", "c"]
    which = {f"rt{i}": names[i % 4] for i in range(len(prompts))}
    reqs = [lora_req(f"rt{i}", p, which[f"rt{i}"], max_new_tokens=24) for i, p in enumerate(prompts)]
    out = run(sched, reqs)
    assert sched.stats.num_retracted_reqs > 0, "the pool was meant to force retraction"
    assert_matches_peft(reqs, which, out)


@pytest.mark.parametrize("page_size", [1, 16])
def test_adapters_sharing_a_prompt_never_share_kv(page_size):
    sched = make_lora_scheduler(page_size)
    prompt = SHARED + SHARED[:10]
    first = run(sched, [lora_req("x1", prompt, "a")])
    assert first["x1"]["cached"] == 0
    others = run(sched, [lora_req("x2", prompt, "b"), lora_req("x3", prompt, None)])
    assert others["x2"]["cached"] == 0 and others["x3"]["cached"] == 0, "KV reused across adapters"
    again = run(sched, [lora_req("x4", prompt, "a"), lora_req("x5", prompt, "b")])
    assert again["x4"]["cached"] > 0 and again["x5"]["cached"] > 0, "an adapter's own prefix is reused"
    which = {"x1": "a", "x2": "b", "x3": None, "x4": "a", "x5": "b"}
    outs = {**first, **others, **again}
    reqs = [lora_req(r, prompt, n) for r, n in which.items()]
    assert_matches_peft(reqs, which, outs)


def test_batches_hold_at_most_max_loras_per_batch():
    sched = make_lora_scheduler(max_loras_per_batch=2)
    seen: list[set] = []
    forward = sched.tp_worker.forward_batch_generation

    def spy(mwb, *args, **kwargs):
        seen.append({i for i in mwb.lora_ids or [] if i is not None})
        return forward(mwb, *args, **kwargs)

    sched.tp_worker.forward_batch_generation = spy
    try:
        reqs, which = mixed_workload("lim")
        out = run(sched, reqs)
    finally:
        del sched.tp_worker.forward_batch_generation
    assert max(len(s) for s in seen) == 2
    assert_matches_peft(reqs, which, out)


def test_unknown_adapter_fails_alone_with_400():
    sched = make_lora_scheduler()
    bad = lora_req("bad", [5, 6, 7], None)
    bad.lora_id = "no-such-id"
    out = run(sched, [bad, lora_req("ok", [5, 6, 7], "a")])
    assert out["bad"]["finish"]["status_code"] == 400
    assert "no-such-id" in out["bad"]["finish"]["message"]
    assert out["ok"]["finish"]["type"] in ("length", "stop")


@pytest.mark.parametrize("folder, needle", [("missing", "no such file"), ("", "has no adapter_config.json")])
def test_load_refused_names_why(tmp_path, folder, needle):
    sched = make_lora_scheduler()
    sched.io.put(LoadLoRAAdapterReqInput("id-x", "x", str(tmp_path / folder)))
    sched.process_input_requests(sched.recv_requests())
    (reply,) = [m for m in sched.io.take_outputs() if isinstance(m, LoRAAdapterReqOutput)]
    assert not reply.success and needle in reply.error_message
    assert "id-x" not in sched.intake.lora.loaded
