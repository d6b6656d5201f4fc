"""The overlap loop's pieces: FutureMap, device streams and events (CPU worker thread; CUDA when
present), step-boundary finishes, failures inside the forward, the trace file, and equal tokens
with the normal loop for seeded sampling."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest
import torch
from sched_utils import (
    TEST_DEVICE,
    assert_matches_oracle,
    assert_no_leak,
    collect,
    gen_req,
    make_scheduler,
    random_prompts,
    run_to_completion,
)

from radixengine.managers.io_struct import AbortReq
from radixengine.managers.overlap_utils import FutureMap, StepTimer
from radixengine.utils.streams import CpuStream, HostStream, StreamError, available_cores, new_stream

# FutureMap ---------------------------------------------------------------------------------------


def test_future_map_resolves_placeholders():
    fm = FutureMap(8, "cpu")
    rows = torch.tensor([0, 3, 7])
    placeholders = fm.placeholders(rows)
    assert placeholders.tolist() == [-1, -4, -8]  # row 0 is -1: never confused with token 0
    fm.store_to_map(rows, torch.tensor([11, 0, 255]))
    ids = torch.cat([placeholders, torch.tensor([5, 0])])
    assert fm.resolve_future(ids).tolist() == [11, 0, 255, 5, 0]
    assert ids.tolist() == [-1, -4, -8, 5, 0]  # the placeholder tensor is left as it was


def test_future_map_slots_are_per_row_so_in_flight_tokens_survive():
    """Two batches in flight on different rows never overwrite each other's tokens; a row's slot
    changes only with that row's next store (a random sequence of steps against a dict)."""
    fm = FutureMap(16, "cpu")
    rng = random.Random(0)
    expected: dict[int, int] = {}
    for _ in range(500):
        rows = rng.sample(range(16), rng.randint(1, 8))
        pending = fm.placeholders(torch.tensor(rows))
        tokens = [rng.randrange(256) for _ in rows]
        fm.store_to_map(torch.tensor(rows), torch.tensor(tokens))
        expected.update(zip(rows, tokens))
        other = [r for r in range(16) if r in expected and r not in rows]
        if other:  # tokens stored earlier for other rows are intact
            got = fm.resolve_future(fm.placeholders(torch.tensor(other))).tolist()
            assert got == [expected[r] for r in other]
        assert fm.resolve_future(pending).tolist() == tokens


def test_a_verify_step_launched_ahead_resolves_from_the_future_map():
    """Speculation under overlap (speculative/spec_overlap.py): the root, the prefix length, the
    slots and the sampling steps come from what the step before stored; the drafts stay only
    where that step emitted what the host assumed."""
    from radixengine.speculative.spec_overlap import FutureVerify, resolve_future_verify
    from radixengine.speculative.spec_verify import VerifyResult

    fm = FutureMap(4, "cpu", spec_width=4)
    rows = torch.tensor([0, 2, 3])
    # Row 0: a verify step at prefix 10 accepted 2 drafts (emitted 21, 22 and the bonus 23);
    # row 2: one that accepted nothing (bonus 30); row 3: a decode step (KV 7 after it, token 40).
    out = torch.tensor([[21, 22, 23, -1], [30, -1, -1, -1]])
    fm.store_verify(
        torch.tensor([0, 2]), VerifyResult(torch.tensor([2, 0]), out, out), torch.tensor([10, 20])
    )
    fm.store_to_map(torch.tensor([3]), torch.tensor([40]), torch.tensor([7]))
    fv = FutureVerify(
        drafts=torch.tensor([[0, 24, 25], [0, 31, 32], [0, 41, 0]]),
        num_nodes=torch.tensor([3, 3, 2]),
        expected=torch.tensor([[21, 22, 23], [30, 99, -1], [-1, -1, -1]]),
        expected_len=torch.tensor([3, 2, -1]),  # row 2 assumed two tokens; row 3: nothing in flight
        window=torch.arange(300).view(3, 100),
        window_start=torch.tensor([10, 20, 7]),
        steps_base=torch.tensor([5, 6, 7]),
    )
    r = resolve_future_verify(fv, rows, fm.spec)
    assert r.trees.tokens[:, 0].tolist() == [23, 30, 40]
    assert r.prefix_lens.tolist() == [13, 21, 7]
    assert r.trees.num_nodes_cpu == [3, 1, 2]  # row 2's drafts assumed an accepted draft
    assert r.out_cache_loc.tolist() == [3, 4, 5, 101, 200, 201]  # window[prefix - start + j]
    assert r.steps.tolist() == [5 + 3, 6 + 1, 7]


# Streams -----------------------------------------------------------------------------------------


def test_cpu_stream_runs_in_order_and_sets_events_when_reached():
    stream = CpuStream("test")
    gate = threading.Event()
    order: list[int] = []
    stream.submit(gate.wait)
    for i in range(5):
        stream.submit(order.append, i)
    event = stream.record_event()
    stream.submit(order.append, 99)
    time.sleep(0.05)
    assert not event.query() and order == []
    gate.set()
    event.synchronize()
    assert order[:5] == [0, 1, 2, 3, 4]
    stream.synchronize()
    assert order == [0, 1, 2, 3, 4, 99]
    assert [label for _, _, label in stream.busy][-1] == "append"
    stream.close()


def test_cpu_stream_exception_surfaces_at_next_sync_and_never_hangs():
    stream = CpuStream("test")
    ran: list[str] = []

    def boom() -> None:
        raise ValueError("bad forward")

    stream.submit(boom)
    stream.submit(ran.append, "skipped")
    event = stream.record_event()
    with pytest.raises(StreamError, match="bad forward") as info:
        event.synchronize(timeout=5)
    assert isinstance(info.value.__cause__, ValueError)
    assert ran == []  # work after the failure is skipped
    with pytest.raises(StreamError):
        stream.synchronize()
    stream.reset_error()
    stream.submit(ran.append, "after reset")
    stream.synchronize()
    assert ran == ["after reset"]
    stream.close()


def test_host_stream_and_cross_stream_wait():
    host = HostStream()
    out: list[int] = []
    host.submit(out.append, 1)
    assert out == [1] and host.record_event().query()
    stream = new_stream("cpu")
    gate = threading.Event()
    stream.submit(gate.wait)
    stream.submit(out.append, 2)
    other = CpuStream("other")
    other.wait_stream(stream)  # other's later work runs after stream's
    other.submit(out.append, 3)
    gate.set()
    other.synchronize()
    assert out == [1, 2, 3]
    stream.close()
    other.close()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.mark.gpu
@needs_cuda
def test_cuda_stream_and_event():
    stream = new_stream("cuda")
    x = torch.ones(1 << 20, device="cuda")
    box = {}

    def work() -> None:
        box["y"] = (x * 2).sum()

    stream.wait_stream(new_stream("cuda"))
    stream.submit(work)
    event = stream.record_event()
    event.synchronize()
    assert event.query() and box["y"].item() == 2 * (1 << 20)


@pytest.mark.gpu
@needs_cuda
def test_overlap_loop_on_cuda_matches_transformers():
    from sched_utils import tiny_model_dir

    from radixengine.managers.scheduler import Scheduler
    from radixengine.managers.scheduler_io import InProcessIO
    from radixengine.server_args import ServerArgs

    reqs = [gen_req(f"g{i}", p, 16) for i, p in enumerate(random_prompts(700, 8, 5, 60))]
    outputs = {}
    for overlap in (False, True):
        args = ServerArgs(
            model_path=tiny_model_dir(),
            device="cuda",
            dtype="float32",
            max_total_tokens=4096,
            chunked_prefill_size=32,
            disable_overlap_schedule=not overlap,
            test_mode=True,
            disable_cuda_graph=True,
        )
        sched = Scheduler(args, io=InProcessIO())
        outputs[overlap] = run_to_completion(sched, reqs)
        assert_matches_oracle(reqs, outputs[overlap])


# The loop ----------------------------------------------------------------------------------------


def test_overlap_is_the_default():
    from radixengine.server_args import ServerArgs

    assert ServerArgs().disable_overlap_schedule is False
    assert make_scheduler(overlap=True).enable_overlap
    assert not make_scheduler().enable_overlap


@pytest.mark.parametrize("page_size", [1, 16])
def test_finishing_exactly_at_the_step_boundary(page_size):
    """Requests finishing on their first or second token are already in the next launched batch:
    that extra slot is freed exactly once (with pages: only when it opened a page)."""
    sched = make_scheduler(overlap=True, page_size=page_size)
    prompts = [random_prompts(710 + n, 1, n, n)[0] for n in (15, 16, 17, 31, 32, 33)]
    reqs = [gen_req(f"b{i}-{m}", p, m) for i, p in enumerate(prompts) for m in (1, 2, 3)]
    results = run_to_completion(sched, reqs)
    assert_matches_oracle(reqs, results)
    # and one at a time, so each finishes while the next decode is already launched
    for r in reqs[:6]:
        run_to_completion(sched, [gen_req(r.rid + "-solo", r.input_ids, r.sampling_params.max_new_tokens)])


def test_abort_of_a_request_in_flight():
    sched = make_scheduler(overlap=True)
    prompts = random_prompts(720, 3, 10, 20)
    reqs = [gen_req(f"f{i}", p, 30, ignore_eos=True) for i, p in enumerate(prompts)]
    sched.io.put(*reqs)
    for _ in range(4):
        sched.process_input_requests(sched.recv_requests())
        sched.run_step()
    assert sched.result_queue  # a batch is in flight
    sched.process_input_requests([AbortReq("f0")])
    sched.run_until_idle()
    assert_no_leak(sched)
    results = collect(sched.io.take_outputs())
    assert results["f0"].finished_reason["type"] == "abort"
    assert_matches_oracle(reqs[1:], results)


class FlakyWorker:
    """Wraps a worker; its forward raises on the n-th call."""

    def __init__(self, worker, fail_at: int) -> None:
        self.worker, self.fail_at, self.calls = worker, fail_at, 0

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def forward_batch_generation(self, mwb):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("simulated device failure")
        return self.worker.forward_batch_generation(mwb)


def _flaky_scheduler(overlap: bool):
    from radixengine.managers.scheduler import Scheduler
    from radixengine.managers.scheduler_io import InProcessIO

    base = make_scheduler(overlap=overlap)
    return Scheduler(base.server_args, tp_worker=FlakyWorker(base.tp_worker, 4), io=InProcessIO())


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_exception_in_forward_fails_its_batch_and_the_loop_goes_on(overlap):
    """Stepped by hand the forward's exception surfaces; in the event loop it ends the requests
    of its batch with a 500 naming it, and the loop serves the next requests."""
    reqs = [gen_req(f"x{i}", p, 10) for i, p in enumerate(random_prompts(730, 3, 5, 10))]
    sched = _flaky_scheduler(overlap)
    sched.io.put(*reqs)
    with pytest.raises((RuntimeError, StreamError), match="simulated device failure"):
        sched.run_until_idle(100)

    sched = _flaky_scheduler(overlap)
    errors: list[BaseException] = []
    outputs: list[object] = []

    def loop() -> None:
        try:
            sched.event_loop_overlap() if overlap else sched.event_loop_normal()
        except BaseException as e:
            errors.append(e)

    def finished(rids: list[str]) -> dict:
        deadline = time.monotonic() + 30
        while True:
            outputs.extend(sched.io.take_outputs())
            results = collect(outputs)
            if all(rid in results and results[rid].finished_reason for rid in rids):
                return results
            assert time.monotonic() < deadline and not errors, (errors, results)
            time.sleep(0.01)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    sched.io.put(*reqs)
    results = finished([r.rid for r in reqs])
    failed = [r for r in reqs if results[r.rid].finished_reason["type"] == "abort"]
    assert failed, results
    for r in failed:
        reason = results[r.rid].finished_reason
        assert reason["status_code"] == 500 and "simulated device failure" in reason["message"]
    assert_matches_oracle([r for r in reqs if r not in failed], results)
    again = [gen_req(f"again{i}", r.input_ids, 10) for i, r in enumerate(reqs)]
    sched.io.put(*again)
    assert_matches_oracle(again, finished([r.rid for r in again]))
    sched.io.close()
    thread.join(30)
    assert not thread.is_alive() and not errors, errors


def test_trace_file_and_step_timer(tmp_path):
    for overlap in (False, True):
        path = tmp_path / f"trace-{overlap}.json"
        sched = make_scheduler(overlap=overlap, trace_file=str(path))
        run_to_completion(
            sched, [gen_req(f"t{i}", p, 8) for i, p in enumerate(random_prompts(740, 4, 5, 30))]
        )
        sched.write_trace()
        events = json.loads(path.read_text())["traceEvents"]
        lanes = {e.get("tid") for e in events if e.get("ph") == "X"}
        assert lanes == {1, 2}
        names = {e["name"] for e in events if e.get("tid") == 1}
        assert {"schedule", "launch", "process"} <= names
        summary = sched.timer.summary()
        assert summary["steps"] > 8 and summary["cpu_ms"] > 0
        assert (summary["wait_ms"] > 0) == overlap and (summary["forward_ms"] > 0) == (not overlap)

    timer = StepTimer()
    with timer.phase("process"):
        with timer.phase("wait"):
            time.sleep(0.02)
    timer.end_step()
    assert timer.summary()["wait_ms"] >= 20 > timer.summary()["process_ms"]


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_seeded_sampling_identical_in_both_loops(policy):
    prompts = random_prompts(750, 10, 5, 40)
    reqs = [
        gen_req(f"s{i}", p, 20, temperature=0.9, top_p=0.95, sampling_seed=1000 + i)
        for i, p in enumerate(prompts)
    ]
    outs = []
    for overlap in (False, True):
        sched = make_scheduler(overlap=overlap, schedule_policy=policy, chunked_prefill_size=16)
        outs.append({rid: r.output_ids for rid, r in run_to_completion(sched, reqs).items()})
    assert outs[0] == outs[1]


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="CPU stream layouts")
@pytest.mark.parametrize("layout", ["inline", "thread"])
def test_cpu_forward_stream_layouts(layout):
    sched = make_scheduler(overlap=True, chunked_prefill_size=16, cpu_forward_stream=layout)
    assert isinstance(sched.model_worker.forward_stream, HostStream if layout == "inline" else CpuStream)
    assert sched.enable_overlap == (layout == "thread")  # inline: the normal step order
    reqs = [gen_req(f"l{i}", p, 12) for i, p in enumerate(random_prompts(760, 8, 5, 50))]
    assert_matches_oracle(reqs, run_to_completion(sched, reqs))
    with pytest.raises(ValueError, match="unknown CPU stream layout"):
        new_stream("cpu", cpu_layout="fibers")


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="CPU stream layouts")
def test_auto_forward_stream_follows_the_core_count():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(available_cores())
        sched = make_scheduler(overlap=True, cpu_forward_stream="auto")
        assert isinstance(sched.model_worker.forward_stream, HostStream) and not sched.enable_overlap
        if available_cores() > 1:
            torch.set_num_threads(available_cores() - 1)
            sched = make_scheduler(overlap=True, cpu_forward_stream="auto")
            assert isinstance(sched.model_worker.forward_stream, CpuStream) and sched.enable_overlap
            sched.close()
    finally:
        torch.set_num_threads(threads)


def test_auto_layout_leaves_a_core_for_the_scheduler():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(available_cores())
        assert isinstance(new_stream("cpu", cpu_layout="auto"), HostStream)
        if available_cores() > 1:
            torch.set_num_threads(available_cores() - 1)
            stream = new_stream("cpu", cpu_layout="auto")
            assert isinstance(stream, CpuStream)
            stream.close()
    finally:
        torch.set_num_threads(threads)
