"""The overlap loop's decode step never makes the host wait for the device between launching a
step and processing the previous one: on a GPU under `torch.cuda.set_sync_debug_mode("error")`,
on the CPU under `HostSyncGuard` (tests/host_sync_guard.py), which records the same operations
on the tensors that would live on the device.

What each step checks: the scheduler's "schedule" and "launch" phases (filtering finished
requests, the retraction check, `prepare_for_decode` and its KV allocation, the sampling info,
`get_model_worker_batch`, the launch), with the results of the step in flight unread. The
result processing (its `copy_done` wait, the cache's frees) is outside, as are prefill steps.
The sampler's own rule (it runs on the forward stream, a worker thread on the CPU) is checked
by `test_the_sync_free_sampler_reads_nothing_from_the_device`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest
import torch
from host_sync_guard import HostSyncGuard
from sched_utils import gen_req, make_scheduler, random_prompts

from radixengine.layers.sampler import Sampler
from radixengine.managers.scheduler import Scheduler
from radixengine.sampling.output_token_counts import OutputTokenCounts
from radixengine.sampling.sampling_batch_info import SamplingBatchInfo
from radixengine.sampling.sampling_params import SamplingParams

LAUNCH_SIDE = ("schedule", "launch")


def watch_launch_side(sched: Scheduler, guard: Callable[[], AbstractContextManager]) -> None:
    """Run `guard()` around every schedule and launch phase of the scheduler's steps."""
    phase = sched.timer.phase

    @contextmanager
    def guarded(name: str) -> Iterator[None]:
        with phase(name):
            if name in LAUNCH_SIDE:
                with guard():
                    yield
            else:
                yield

    sched.timer.phase = guarded


def start_decoding(sched: Scheduler, params: list[dict], seed: int = 11) -> None:
    """Submit one request per entry of `params` and step (unwatched) until all of them decode."""
    prompts = random_prompts(seed, len(params), 6, 40)
    sched.io.put(*(gen_req(f"r{i}", p, **kw) for i, (p, kw) in enumerate(zip(prompts, params))))
    for _ in range(50):
        sched.process_input_requests(sched.recv_requests(block=False))
        batch = sched.run_step()
        if batch is not None and batch.forward_mode.is_decode() and not sched.waiting_queue:
            return
    raise AssertionError("the requests never reached a decode step")


def mark_device_state(guard: HostSyncGuard, sched: Scheduler) -> None:
    """Mark what lives on the device once the steps in flight have published their results:
    the pools, the running batch, the batches and results in flight, the FutureMap."""
    for _, result in sched.result_queue:
        if result.copy_done is not None:
            result.copy_done.synchronize()
    guard.mark(
        sched.req_to_token_pool,
        sched.token_to_kv_pool_allocator,
        sched.token_to_kv_pool_allocator.get_kvcache(),
        sched.running_batch,
        list(sched.result_queue),
        sched.model_worker.future_map,
    )


# Greedy and sampled rows, penalties, seeds, min_new_tokens, logit_bias, a request finishing
# early (its removal from the batch is part of a step): every per-step path of the batch.
MIXED_PARAMS = [
    dict(max_new_tokens=40),
    dict(max_new_tokens=40, temperature=0.8, top_p=0.9, top_k=20, sampling_seed=3),
    dict(max_new_tokens=40, temperature=1.0, min_p=0.1, frequency_penalty=0.5, repetition_penalty=1.2),
    dict(max_new_tokens=6, temperature=0.7, presence_penalty=0.3, min_new_tokens=4),
    dict(max_new_tokens=40, temperature=0.9, logit_bias={"5": 2.0}),
]


@pytest.mark.parametrize("page_size", [1, 4])
def test_overlap_decode_steps_read_nothing_from_the_device(page_size: int) -> None:
    sched = make_scheduler(overlap=True, page_size=page_size, device="cpu")
    # As on a GPU: the allocator's checks of slot values (each a host read there) are off.
    sched.token_to_kv_pool_allocator.device_checks = False
    start_decoding(sched, MIXED_PARAMS)
    guard = HostSyncGuard()
    watch_launch_side(sched, lambda: guard)
    decode_steps = 0
    for _ in range(12):
        mark_device_state(guard, sched)
        guard.syncs.clear()
        batch = sched.run_step()
        assert batch is not None and batch.forward_mode.is_decode()
        assert not guard.syncs, "\n\n".join(map(str, guard.syncs))
        decode_steps += 1
    assert decode_steps == 12
    sched.run_until_idle()
    sched.token_to_kv_pool_allocator.device_checks = True


def test_the_guard_catches_what_would_sync() -> None:
    """Each of the sync sites the decode step once had, put back, is recorded."""
    device_t = torch.arange(8)
    mask = torch.ones(8, dtype=torch.bool)
    host = torch.arange(8)
    cases = [
        lambda: bool(torch.isfinite(device_t.float()).all()),  # the sampler's finite check
        lambda: mask.__setitem__(device_t[:2], False),  # the allocator's free-mask write
        lambda: host.to("cpu"),  # the sampling info's per-step steps copy
        lambda: device_t.tolist(),
        lambda: int(device_t.max()),
        lambda: device_t[device_t > 3],
        lambda: torch.unique(device_t),
        lambda: torch.tensor([1, 2], device="cpu"),
        lambda: host.copy_(device_t),
        lambda: torch.repeat_interleave(device_t, device_t),
    ]
    for case in cases:
        guard = HostSyncGuard()
        guard.mark(device_t, mask)
        with guard:
            case()
        assert len(guard.syncs) == 1, (case, guard.syncs)
    guard = HostSyncGuard()
    guard.mark(device_t)
    with guard:  # device work, non-blocking copies and host work: none recorded
        y = torch.where(device_t > 3, device_t, 0) + 1
        y.index_fill_(0, device_t[:2], 0)
        pinned = torch.empty(8, dtype=torch.int64)
        pinned.copy_(y, non_blocking=True)
        host.to("cpu", non_blocking=True)
        int(host.sum())
        host.tolist()
        assert guard.is_marked(y) and guard.is_marked(pinned)
    assert not guard.syncs, guard.syncs


def test_the_sync_free_sampler_reads_nothing_from_the_device() -> None:
    """The GPU sampler (sync_free): finite check, penalties, top-k / top-p / min-p, seeds,
    min_new_tokens, logit_bias and logprobs with no read of the logits or the sampling info;
    the flag of a row with nothing to sample comes back as a tensor, read with the tokens."""
    params = [SamplingParams(**kw) for kw in MIXED_PARAMS] + [SamplingParams(temperature=0.5, top_p=0.5)]
    info = SamplingBatchInfo.from_sampling_params(params, [1] * len(params), "cpu", 64, frozenset({2}))
    n = len(params)
    info.output_token_counts = OutputTokenCounts.from_output_ids([[3, 4, 4]] * n, 64, "cpu")
    info.output_token_counts_out = torch.empty((n, 64))
    logits = torch.randn(n, 64)
    logits[1] = float("nan")
    guard = HostSyncGuard()
    guard.mark(logits, info)
    with guard:
        ids, logprobs, invalid, top = Sampler(sync_free=True)(logits, info, True, 3)
    assert not guard.syncs, "\n\n".join(map(str, guard.syncs))
    assert invalid.tolist() == [i == 1 for i in range(len(params))]
    assert ids.shape == (len(params),) and top.idx.shape == (len(params), 3)
    guard = HostSyncGuard()
    guard.mark(logits, info)
    with guard:  # the CPU sampler reads (the check's early exit, top-p's width): recorded
        Sampler()(logits, info, True)
    assert guard.syncs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page_size", [1, 4])
def test_overlap_decode_steps_do_not_sync_on_cuda(page_size: int) -> None:
    """The same steps on the GPU under torch.cuda.set_sync_debug_mode: every synchronizing CUDA
    call in the watched phases is a warning, recorded (an error raised inside the step would be
    turned into an aborted request by the scheduler, not a failed test)."""
    recorded: list[warnings.WarningMessage] = []

    @contextmanager
    def warn_on_sync() -> Iterator[None]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")
        recorded.extend(w for w in caught if "synchroniz" in str(w.message))

    sched = make_scheduler(overlap=True, page_size=page_size, device="cuda")
    start_decoding(sched, MIXED_PARAMS)
    watch_launch_side(sched, warn_on_sync)
    for _ in range(12):
        batch = sched.run_step()
        assert batch is not None and batch.forward_mode.is_decode()
        assert not recorded, [f"{w.filename}:{w.lineno} {w.message}" for w in recorded]
    sched.run_until_idle()
