"""Speculative decoding under tensor parallelism (--tp-size 2, gloo on the CPU): NGRAM and
STANDALONE with a draft equal to the target and with an unrelated draft, in the overlap loop and
the normal loop, give one rank's tokens without speculation, greedy and seeded
sampling (the seeded request twice: the same tokens); verify steps ran (but where the unrelated
draft's drafts are dropped under overlap); unseeded sampling finishes
with the ranks in step (--test-mode compares their schedulers after every step); no KV leaked.
Building the draft model (rank 0 alone) leaves the random generators as they were; the rank
comparison tells equal values from different ones."""

from __future__ import annotations

import multiprocessing as mp
import random
import traceback
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from test_engine_utils import build_tiny_model, wait_for_idle_accounting

from radixengine import Engine
from radixengine.managers.scheduler_components.speculative_drafter import make_draft_runner
from radixengine.server_args import ServerArgs
from radixengine.utils.network import get_free_port
from radixengine.utils.random_seed import set_random_seed

ENGINE = dict(
    device="cpu",
    dtype="float32",
    num_threads=1,
    log_level="warning",
    random_seed=7,
    max_total_tokens=4096,
    test_mode=True,  # the ranks compare their schedulers every step; the idle accounting raises
    watchdog_timeout=120,  # a collective the ranks disagree on raises instead of hanging long
)
GREEDY = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
SEEDED = {"max_new_tokens": 10, "temperature": 0.9, "top_p": 0.95, "sampling_seed": 11, "ignore_eos": True}
UNSEEDED = {"max_new_tokens": 10, "temperature": 0.9, "ignore_eos": True}
# tokens a verify step gave, on average: a draft equal to the target gives its 3 drafts + the bonus
MIN_ACCEPT_LENGTH = {"ngram": 1.5, "standalone-self": 3.5, "standalone-unrelated": 1.0}
LOOPS = {"overlap": dict(cpu_forward_stream="thread"), "normal": dict(disable_overlap_schedule=True)}


@dataclass(frozen=True)
class Models:
    target: str
    unrelated: str  # same tokenizer, other weights


@dataclass(frozen=True)
class Plain:
    """One rank without speculation: the prompts and their outputs."""

    prompts: list[list[int]]
    greedy: list[list[int]]
    seeded: list[list[int]]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    return Models(
        build_tiny_model(str(tmp_path_factory.mktemp("target"))),
        build_tiny_model(str(tmp_path_factory.mktemp("unrelated")), seed=9),
    )


def _outputs(engine: Engine, prompts: list[list[int]], params: dict | list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]


@pytest.fixture(scope="module")
def plain(models) -> Plain:
    """Two random prompts, and the first followed by its greedy output, which ends in a loop
    (`115, 1, 399` twice): that prompt's continuation goes on repeating its tail, what n-gram
    drafts propose, from the first step on (so it verifies in any batch, in either loop)."""
    rng = random.Random(3)
    first, second = ([rng.randrange(3, 390) for _ in range(n)] for n in (20, 9))
    engine = Engine(model_path=models.target, **ENGINE)
    try:
        prompts = [first + _outputs(engine, [first], GREEDY)[0], first, second]
        return Plain(prompts, _outputs(engine, prompts, GREEDY), _outputs(engine, prompts, SEEDED))
    finally:
        engine.shutdown()


def _speculation(name: str, models: Models) -> dict:
    if name == "ngram":
        return dict(speculative_algorithm="NGRAM")
    draft = models.target if name == "standalone-self" else models.unrelated
    return dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=draft)


def _assert_idle_accounting(engine: Engine, timeout: float = 20.0) -> dict:
    return wait_for_idle_accounting(engine.get_server_info, timeout)


# Under overlap the drafts follow a guess of the bonus token of the step in flight, which an
# unrelated draft almost never gets right: its drafts are dropped and each step verifies the root
# alone (a decode step, not counted as a verify). That case checks that those steps stay exact and
# the ranks in step, not that verify steps ran.
DROPPED_DRAFTS = ("standalone-unrelated", "overlap")
CASES = [
    ("ngram", "overlap"),
    ("ngram", "normal"),
    ("standalone-self", "overlap"),
    ("standalone-self", "normal"),
    ("standalone-unrelated", "overlap"),
    ("standalone-unrelated", "normal"),
]


def _sample(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """The seeded requests, one of them twice, then unseeded ones, in one batch."""
    params = [SEEDED] * 3 + [SEEDED] + [UNSEEDED] * 3
    return _outputs(engine, prompts + prompts[:1] + prompts, params)


@pytest.mark.parametrize("spec,loop", CASES)
def test_tp2_speculation_gives_one_ranks_tokens(spec, loop, models, plain):
    engine = Engine(
        model_path=models.target, tp_size=2, **ENGINE, **_speculation(spec, models), **LOOPS[loop]
    )
    try:
        greedy = engine.generate(input_ids=plain.prompts, sampling_params=GREEDY)
        assert [o["output_ids"] for o in greedy] == plain.greedy
        accept_length = _assert_idle_accounting(engine)["avg_spec_accept_length"]
        if (spec, loop) != DROPPED_DRAFTS:
            assert greedy[0]["meta_info"]["spec_verify_ct"] > 0
            assert accept_length >= MIN_ACCEPT_LENGTH[spec]
        # A seeded request emits the tokens it does without speculation; the unseeded ones finish
        # with the ranks in step (--test-mode).
        sampled = _sample(engine, plain.prompts)
        assert sampled[:4] == plain.seeded + plain.seeded[:1]
        assert [len(o) for o in sampled[4:]] == [10] * 3
        _assert_idle_accounting(engine)
    finally:
        engine.shutdown()


def test_building_the_draft_model_leaves_the_generators_alone(models):
    """Under tensor parallelism rank 0 alone builds the draft model, whose runner seeds the
    generators and whose random (dummy) weights draw from them: building it must leave them as
    they were, or unseeded sampling would differ between the ranks."""
    args = ServerArgs(
        model_path=models.target,
        device="cpu",
        dtype="float32",
        load_format="dummy",
        max_total_tokens=256,
        random_seed=7,
        **_speculation("standalone-unrelated", models),
    )
    set_random_seed(123)
    before = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    runner = make_draft_runner(args)
    assert runner.tp_size == 1 and runner.model_config.model_path == models.unrelated
    assert torch.equal(torch.get_rng_state(), before[0])
    assert np.array_equal(np.random.get_state()[1], before[1]) and random.getstate() == before[2]


# The rank comparison --------------------------------------------------------------------------


def _agree_main(rank: int, port: int, results) -> None:
    from radixengine.distributed import all_ranks_agree, destroy_distributed, init_distributed

    try:
        torch.set_num_threads(1)
        init_distributed(2, rank, f"tcp://127.0.0.1:{port}", timeout_s=120)
        results.put((rank, [all_ranks_agree(5), all_ranks_agree(rank), all_ranks_agree(-(1 << 40))], None))
        destroy_distributed()
    except BaseException:
        results.put((rank, None, traceback.format_exc()))


def test_all_ranks_agree_tells_equal_values_from_different_ones():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = get_free_port()
    procs = [ctx.Process(target=_agree_main, args=(r, port, results), daemon=True) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        out = {}
        for _ in procs:
            rank, agreed, error = results.get(timeout=120)
            assert error is None, error
            out[rank] = agreed
        assert out == {0: [True, False, True], 1: [True, False, True]}
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
