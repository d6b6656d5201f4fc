"""Speculative decoding under tensor parallelism (--tp-size 2, gloo on the CPU), in the overlap
loop and the normal loop: NGRAM and STANDALONE (a draft equal to the target, an unrelated draft)
give one rank's tokens without speculation, greedy and seeded sampling (twice: the same tokens);
verify steps ran; unseeded sampling finishes with the ranks in step (--test-mode compares their
schedulers after every step); no KV leaked. And the rank comparison itself tells equal values
from different ones."""

from __future__ import annotations

import multiprocessing as mp
import random
import time
import traceback
from dataclasses import dataclass

import pytest
import torch
from test_engine_utils import build_tiny_model

from radixengine import Engine
from radixengine.utils.network import get_free_port

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
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
SEEDED = {"max_new_tokens": 16, "temperature": 0.9, "top_p": 0.95, "sampling_seed": 11, "ignore_eos": True}
UNSEEDED = {"max_new_tokens": 16, "temperature": 0.9, "ignore_eos": True}
LOOPS = {"overlap": dict(cpu_forward_stream="thread"), "normal": dict(disable_overlap_schedule=True)}


@dataclass(frozen=True)
class Models:
    target: str
    unrelated: str  # same tokenizer, other weights


@dataclass(frozen=True)
class Plain:
    greedy: list[list[int]]
    seeded: list[list[int]]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    return Models(
        build_tiny_model(str(tmp_path_factory.mktemp("target"))),
        build_tiny_model(str(tmp_path_factory.mktemp("unrelated")), seed=9),
    )


def _prompts() -> list[list[int]]:
    """A prompt that repeats itself (n-gram drafts hit), and two random ones."""
    rng = random.Random(3)
    base = [rng.randrange(3, 390) for _ in range(12)]
    return [base * 3, [rng.randrange(3, 390) for _ in range(20)], [rng.randrange(3, 390) for _ in range(9)]]


def _outputs(engine: Engine, params: dict) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=_prompts(), sampling_params=params)]


@pytest.fixture(scope="module")
def plain(models) -> Plain:
    """One rank without speculation."""
    engine = Engine(model_path=models.target, **ENGINE)
    try:
        return Plain(_outputs(engine, GREEDY), _outputs(engine, SEEDED))
    finally:
        engine.shutdown()


def _speculation(name: str, models: Models) -> dict:
    if name == "ngram":
        return dict(speculative_algorithm="NGRAM")
    draft = models.target if name == "standalone-self" else models.unrelated
    return dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=draft)


def _assert_idle_accounting(engine: Engine, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = engine.get_server_info()
        idle = info["num_running_reqs"] == 0 and info["num_queue_reqs"] == 0
        total = info["available_tokens"] + info["evictable_tokens"] + info["protected_tokens"]
        if idle and total == info["max_total_tokens"]:
            return info
        assert time.monotonic() < deadline, f"not idle or tokens leaked: {info}"
        time.sleep(0.2)


@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("spec", ["ngram", "standalone-self", "standalone-unrelated"])
def test_tp2_speculation_gives_one_ranks_tokens(spec, loop, models, plain):
    engine = Engine(
        model_path=models.target, tp_size=2, **ENGINE, **_speculation(spec, models), **LOOPS[loop]
    )
    try:
        greedy = engine.generate(input_ids=_prompts(), sampling_params=GREEDY)
        assert [o["output_ids"] for o in greedy] == plain.greedy
        assert greedy[0]["meta_info"]["spec_verify_ct"] > 0
        accept = _assert_idle_accounting(engine)["avg_spec_accept_length"]
        assert accept > (3.0 if spec == "standalone-self" else 1.0)  # 3 drafts + the bonus a step
        for attempt in range(2):  # a seeded request emits the tokens it does without speculation
            assert _outputs(engine, SEEDED) == plain.seeded, attempt
        assert [len(o) for o in _outputs(engine, UNSEEDED)] == [16] * 3
        _assert_idle_accounting(engine)
    finally:
        engine.shutdown()


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
