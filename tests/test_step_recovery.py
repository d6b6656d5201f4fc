"""StepRecovery in process (the fast companion of tests/test_step_containment.py): in the normal and
the overlap loop, a fault in each phase of a step ends that step's request with a 500 naming it,
the others get their greedy tokens, nothing leaks; what cannot be contained still raises."""

from __future__ import annotations

import pytest
from sched_utils import assert_no_leak, collect, gen_req, make_scheduler, oracle_greedy, random_prompts

from radixengine.managers.scheduler_components.step_recovery import UncontainedStepError
from radixengine.mem_cache.accounting import TokenAccountingError
from radixengine.utils import fault_injection
from radixengine.utils.fault_injection import FaultSpec, InjectedFault, parse_faults


@pytest.fixture
def faults(monkeypatch):
    """Set the process's faults (as RADIXENGINE_TEST_FAULT would), counting from 1."""

    def set_faults(text: str) -> None:
        monkeypatch.setattr(fault_injection, "FAULTS", parse_faults(text))
        monkeypatch.setattr(fault_injection, "_counts", {})

    return set_faults


def run_contained(sched, max_steps: int = 5000) -> None:
    """The event loop's step, containment included, until idle."""
    for _ in range(max_steps):
        sched.process_input_requests(sched.recv_requests(block=False))
        try:
            batch = sched.run_step()
        except Exception as e:
            sched.contain_step_failure(e)
            batch = None
        if batch is None and sched.is_idle() and not sched.io.inbox:
            return
    raise AssertionError("not idle")


@pytest.mark.parametrize("phase", ["schedule", "prepare", "forward", "sample", "process"])
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_fault_in_each_phase_ends_that_steps_request_alone(phase, overlap, faults):
    faults(f"{phase}:3")
    prompts = random_prompts(5, 4, 8, 16)
    sched = make_scheduler(overlap=overlap, max_running_requests=1)
    sched.io.put(*[gen_req(f"r{i}", p, 8) for i, p in enumerate(prompts)])
    run_contained(sched)
    results = collect(sched.io.take_outputs())
    reason = results["r0"].finished_reason  # admitted first: the 3rd step is its own
    assert reason["status_code"] == 500, reason
    assert f"InjectedFault: injected fault in the {phase} phase" in reason["message"]
    for i, p in enumerate(prompts[1:], start=1):
        assert results[f"r{i}"].output_ids == oracle_greedy(p, 8)
    assert_no_leak(sched)
    assert sched.recovery.contained == 1


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_failing_prefill_ends_its_request_and_the_running_ones_keep_their_tokens(overlap, faults):
    """Three requests decode; the prefill of a fourth fails: it alone ends, the three are
    retracted (the pools are emptied) and finish with their greedy tokens."""
    prompts = random_prompts(4, 4, 8, 16)
    sched = make_scheduler(overlap=overlap)
    sched.io.put(*[gen_req(f"r{i}", p, 12) for i, p in enumerate(prompts[:3])])
    for _ in range(4):  # prefilled, then decoding
        sched.process_input_requests(sched.recv_requests(block=False))
        sched.run_step()
    assert len(sched.running_batch.reqs) == 3
    faults("schedule:1")  # the next batch scheduled: the fourth request's prefill
    sched.io.put(gen_req("r3", prompts[3], 12))
    run_contained(sched)
    results = collect(sched.io.take_outputs())
    reason = results["r3"].finished_reason
    assert reason["status_code"] == 500 and "schedule phase" in reason["message"], reason
    for i, p in enumerate(prompts[:3]):
        assert results[f"r{i}"].output_ids == oracle_greedy(p, 12), i
    assert_no_leak(sched)
    assert sched.recovery.contained == 1


def test_two_steps_in_a_row_that_end_nothing_are_not_contained():
    """One such failure is contained (the overlap loop's stale batch: its requests finished a
    step earlier); a second one at the next step means the steps keep failing: the process exits."""
    sched = make_scheduler()
    sched.contain_step_failure(RuntimeError("boom"))  # at step 0; the recovery ends step 0
    assert sched.recovery.contained == 1
    with pytest.raises(UncontainedStepError, match="two steps in a row"):
        sched.contain_step_failure(RuntimeError("boom"))


def test_an_accounting_error_is_not_contained():
    sched = make_scheduler()
    sched.io.put(gen_req("a", [5, 6, 8], 4))
    sched.process_input_requests(sched.recv_requests())
    with pytest.raises(TokenAccountingError):
        sched.contain_step_failure(TokenAccountingError("leak"))


def test_fault_specs():
    assert parse_faults("forward:3, sample:1:SIGKILL") == (
        FaultSpec("forward", 3, None),
        FaultSpec("sample", 1, 9),
    )
    assert parse_faults("") == ()
    for bad in ("forward", "nowhere:1", "forward:0", "forward:x", "forward:1:SIGNOPE"):
        with pytest.raises(ValueError, match="RADIXENGINE_TEST_FAULT"):
            parse_faults(bad)
    assert issubclass(InjectedFault, RuntimeError)
