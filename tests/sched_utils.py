"""Shared fixtures for the scheduler tests: a tiny random-weight Llama (built once per process),
model workers cached by pool shape, a scheduler factory, a run-to-completion helper, and the
transformers greedy oracle (cached per prompt within the process)."""

from __future__ import annotations

import atexit
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

import torch

from radixengine.managers.io_struct import AbortReq, BatchTokenIDOut, TokenizedGenerateReqInput
from radixengine.managers.req import Req
from radixengine.managers.schedule_policy import SchedulePolicy
from radixengine.managers.scheduler import Scheduler
from radixengine.managers.scheduler_io import InProcessIO
from radixengine.mem_cache.accounting import check_token_accounting
from radixengine.model_executor.tp_worker import TpModelWorker
from radixengine.sampling.sampling_params import SamplingParams
from radixengine.server_args import ServerArgs

# RADIXENGINE_TEST_DEVICE=cuda runs the scheduler suites on a GPU (the oracle stays on the CPU).
TEST_DEVICE = os.environ.get("RADIXENGINE_TEST_DEVICE", "cpu")
VOCAB = 256
EOS = 7  # the tiny model's EOS id (greedy hits it now and then: EOS finishes get exercised)
TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=EOS,
)


# Model -------------------------------------------------------------------------------------------


@cache
def tiny_model_dir() -> str:
    """A random-weight Llama saved as safetensors in a temporary folder (once per process)."""
    import transformers

    folder = Path(tempfile.mkdtemp(prefix="radixengine-sched-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    torch.manual_seed(1234)
    config = transformers.LlamaConfig(**TINY_LLAMA)
    config.architectures = ["LlamaForCausalLM"]
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():  # peaked logits: greedy argmax far from ties
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.save_pretrained(folder)
    return str(folder)


@cache
def _hf_model():
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32).eval()


_ORACLE: dict[tuple, list[int]] = {}


def oracle_greedy(prompt: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """transformers' greedy continuation (EOS included when it stops there); cached."""
    key = (tuple(prompt), max_new_tokens, ignore_eos)
    if key not in _ORACLE:
        model = _hf_model()
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None if ignore_eos else EOS,
                pad_token_id=0,
            )
        _ORACLE[key] = out[0, len(prompt) :].tolist()
    return _ORACLE[key]


# Schedulers --------------------------------------------------------------------------------------

_WORKER_ARGS = (
    "page_size",
    "max_total_tokens",
    "max_running_requests",
    "attention_backend",
    "disable_shared_prefix_attention",
    "shared_prefix_attention_min_len",
    "kv_cache_dtype",
    "device",
)


@lru_cache(maxsize=8)
def _worker(
    page_size: int,
    max_total_tokens: int,
    max_running_requests: int | None,
    attention_backend: str,
    disable_shared_prefix_attention: bool,
    shared_prefix_attention_min_len: int,
    kv_cache_dtype: str = "auto",
    device: str = TEST_DEVICE,
) -> TpModelWorker:
    return TpModelWorker(
        ServerArgs(
            model_path=tiny_model_dir(),
            device=device,
            dtype="float32",
            attention_backend=attention_backend,
            disable_shared_prefix_attention=disable_shared_prefix_attention,
            shared_prefix_attention_min_len=shared_prefix_attention_min_len,
            kv_cache_dtype=kv_cache_dtype,
            page_size=page_size,
            max_total_tokens=max_total_tokens,
            max_running_requests=max_running_requests,
            num_threads=1,  # tiny matrices: threads only add overhead on a shared machine
        )
    )


def make_scheduler(
    tokenizer=None, overlap: bool = False, eos_token_ids: frozenset[int] | None = None, **overrides
) -> Scheduler:
    """A scheduler over a cached worker whose pools are cleared first; test mode (the idle
    self-check raises); the overlap loop if `overlap`."""
    args = dict(
        model_path=tiny_model_dir(),
        device=TEST_DEVICE,
        dtype="float32",
        attention_backend="torch_native",
        page_size=1,
        max_total_tokens=4096,
        chunked_prefill_size=-1,
        test_mode=True,
        disable_overlap_schedule=not overlap,
        cpu_forward_stream="thread",  # overlap tests exercise the worker thread whatever the core count
    )
    args.update(overrides)
    server_args = ServerArgs(**args)
    worker = _worker(*(getattr(server_args, k) for k in _WORKER_ARGS))
    req_pool, allocator = worker.get_memory_pool()
    req_pool.clear()
    allocator.clear()
    return Scheduler(
        server_args, tp_worker=worker, tokenizer=tokenizer, io=InProcessIO(), eos_token_ids=eos_token_ids
    )


# Requests ----------------------------------------------------------------------------------------


def gen_req(
    rid: str,
    ids: list[int],
    max_new_tokens: int = 16,
    priority: int | None = None,
    interactive: bool = True,
    **params,
):
    params.setdefault("temperature", 0.0)
    return TokenizedGenerateReqInput(
        rid=rid,
        input_text=None,
        input_ids=list(ids),
        sampling_params=SamplingParams(max_new_tokens=max_new_tokens, **params),
        priority=priority,
        interactive=interactive,
    )


def random_prompts(
    seed: int, n: int, min_len: int = 4, max_len: int = 80, shared: list[list[int]] | None = None
) -> list[list[int]]:
    """Random token ids (never EOS); with `shared`, each prompt starts with one of those prefixes."""
    rng = random.Random(seed)
    tokens = [t for t in range(2, VOCAB) if t != EOS]
    prompts = []
    for _ in range(n):
        prefix = list(rng.choice(shared)) if shared else []
        prompts.append(prefix + [rng.choice(tokens) for _ in range(rng.randint(min_len, max_len))])
    return prompts


@dataclass
class ReqResult:
    output_ids: list[int]
    finished_reason: dict | None
    prompt_tokens: int
    cached_tokens: int
    num_messages: int = 0


def collect(outputs: list[object]) -> dict[str, ReqResult]:
    """The state of each request across the scheduler's BatchTokenIDOut messages (each carries
    only the output ids new since the request's previous message: they are concatenated)."""
    results: dict[str, ReqResult] = {}
    for msg in outputs:
        if not isinstance(msg, BatchTokenIDOut):
            continue
        for i, rid in enumerate(msg.rids):
            prev = results.get(rid)
            assert prev is None or prev.finished_reason is None, f"{rid}: output after it finished"
            results[rid] = ReqResult(
                (prev.output_ids if prev else []) + msg.output_ids[i],
                msg.finished_reasons[i],
                msg.prompt_tokens[i],
                msg.cached_tokens[i],
                (prev.num_messages if prev else 0) + 1,
            )
    return results


def run_to_completion(sched: Scheduler, reqs: list, max_steps: int = 20_000) -> dict[str, ReqResult]:
    """Submit `reqs` (TokenizedGenerateReqInput or AbortReq) at once and step until idle; every
    request must have finished and the token accounting must hold."""
    sched.io.put(*reqs)
    sched.run_until_idle(max_steps)
    results = collect(sched.io.take_outputs())
    for r in reqs:
        if not isinstance(r, AbortReq):
            assert results[r.rid].finished_reason is not None, f"{r.rid} did not finish"
    assert_no_leak(sched)
    return results


def assert_no_leak(sched: Scheduler) -> None:
    assert sched.is_idle()
    check_token_accounting(sched.token_to_kv_pool_allocator, sched.tree_cache, sched.req_to_token_pool)
    assert sched.tree_cache.protected_size() == 0


def assert_matches_oracle(reqs: list, results: dict[str, ReqResult]) -> None:
    for r in reqs:
        params = r.sampling_params
        expected = oracle_greedy(r.input_ids, params.max_new_tokens, params.ignore_eos)
        assert results[r.rid].output_ids == expected, f"{r.rid}: tokens differ from transformers"


def oracle_greedy_min_new_tokens(
    prompt: list[int], max_new: int, min_new: int, stop_ids: list[int]
) -> list[int]:
    """transformers' greedy continuation with `stop_ids` as its EOS set and min_new_tokens (its
    MinNewTokensLengthLogitsProcessor keeps them from being sampled before the minimum)."""
    with torch.no_grad():
        out = _hf_model().generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=max_new,
            min_new_tokens=min_new,
            do_sample=False,
            eos_token_id=stop_ids,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def order(policy: SchedulePolicy, queue: list[Req]) -> bool:
    """What admission does each round: match the prefixes if the policy reads them, then order.
    Returns whether it matched."""
    return policy.match_and_order(queue, lambda r: r.init_next_round_input(policy.tree_cache))
