"""Tensor parallelism (--tp-size) on the CPU with gloo, two ranks of one thread each: the sharded
layers give transformers' greedy tokens (Llama, Qwen2, Qwen3, and key/value heads split unevenly
or replicated); the engine with two ranks matches transformers with the radix cache on and off,
the overlap schedule on and off and a pool small enough to retract; a killed rank ends the engine
with an error naming it; start-up refuses a model that cannot be split, saying why."""

from __future__ import annotations

import os
import random
import signal

import httpx
import psutil
import pytest
import torch
from model_utils import make_runner, save_tiny_model
from test_engine_utils import (
    build_tiny_model,
    hf_greedy,
    launch_test_server,
    load_hf_model,
    start_test_server,
    stop_test_server,
)
from tp_utils import block_modules, greedy_tokens, tp_greedy

from radixengine import Engine
from radixengine.engine import EngineDeadError
from radixengine.layers import gguf_quant_ops
from radixengine.layers.linear import head_ranges
from radixengine.server_args import ServerArgs
from radixengine.utils.network import get_free_port

MAX_NEW = 12
needs_native = pytest.mark.skipif(
    not gguf_quant_ops.quant_native_available(), reason="the native CPU kernels are not built"
)
PROMPTS = [list(range(5, 30)), [7, 3, 9, 11, 200, 17, 4, 4, 8]]

MODELS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    # 3 key/value heads over 2 ranks: 1 and 2 (SmolLM2-135M's 9 / 3 heads have the same split)
    "llama-uneven-kv": ("llama", dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96)),
    # 1 key/value head replicated on both ranks, each with 2 of its 4 query heads
    "qwen2-replicated-kv": ("qwen2", dict(num_key_value_heads=1)),
    "gemma2": ("gemma2", {}),
}


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    """Every model saved, then run by one pair of rank processes (spawning them costs seconds)."""
    models = {}
    for name, (arch, overrides) in MODELS.items():
        path = str(tmp_path_factory.mktemp(name))
        models[name] = (path, save_tiny_model(arch, path, seed=5, **overrides))
    runs = tp_greedy([(path, {}) for path, _ in models.values()], 2, PROMPTS, MAX_NEW)
    return models, {name: (runs[0][i], runs[1][i]) for i, name in enumerate(models)}


@pytest.mark.parametrize("name", list(MODELS))
def test_tp2_greedy_equals_tp1_and_transformers(name, tp_runs):
    models, runs = tp_runs
    path, hf = models[name]
    torch.set_num_threads(1)
    expected = hf_greedy(hf, PROMPTS, MAX_NEW)
    assert greedy_tokens(make_runner(path), PROMPTS, MAX_NEW) == expected
    assert [tokens for _, tokens, _ in runs[name]] == [expected, expected]
    kv = hf.config.num_key_value_heads
    assert [kv_heads for kv_heads, _, _ in runs[name]] == {3: [1, 2], 1: [1, 1]}.get(kv, [kv // 2] * 2)


@needs_native
def test_tp2_gguf_block_linears_equal_tp1(gguf_path):
    """SmolLM2-135M (9 query / 3 key-value heads, Q4_1 linears, Q8_0 tied embedding): each rank
    keeps GGUF blocks for its slice of every linear (o_proj's columns 192 / 384 wide, whole
    32-weight blocks) and decodes the tokens one rank decodes."""
    prompts = [[1, 504, 3458, 282, 4649, 30], [1, 9690, 2114, 253, 1812, 42, 105, 7]]
    args = dict(max_total_tokens=256, quantization="gguf")
    torch.set_num_threads(1)
    runner = make_runner(gguf_path, **args)
    expected = greedy_tokens(runner, prompts, 8)
    runs = tp_greedy([(gguf_path, args)], 2, prompts, 8)
    assert [runs[r][0][1] for r in (0, 1)] == [expected, expected]
    assert [runs[r][0][2] for r in (0, 1)] == [block_modules(runner)] * 2 == [4 * 30 + 1] * 2


def test_head_ranges():
    assert head_ranges(4, 2, 2, 1) == ((2, 2), (1, 1))
    assert head_ranges(9, 3, 2, 0) == ((0, 3), (0, 1))
    assert head_ranges(9, 3, 2, 1) == ((3, 6), (1, 2))
    assert head_ranges(8, 2, 4, 3) == ((6, 2), (1, 1))
    with pytest.raises(ValueError, match="--tp-size 4 exceeds the model's 1 key/value heads"):
        head_ranges(2, 1, 4, 0)


def test_tp_flags_are_checked():
    with pytest.raises(ValueError, match="--tp-size 3 must be a multiple of --nnodes 2"):
        ServerArgs(tp_size=3, nnodes=2, dist_init_addr="10.0.0.1:5000")
    with pytest.raises(ValueError, match="--nnodes > 1 needs --dist-init-addr"):
        ServerArgs(tp_size=2, nnodes=2)
    with pytest.raises(ValueError, match="--dist-init-addr must be HOST:PORT"):
        ServerArgs(tp_size=2, dist_init_addr="10.0.0.1")
    with pytest.raises(ValueError, match="--node-rank must be in"):
        ServerArgs(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="10.0.0.1:5000")


# The engine with two ranks ------------------------------------------------------------------

GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
# gloo ranks on the CPU, also on a machine with a GPU (CUDA TP needs one GPU a rank)
ENGINE = dict(
    device="cpu",
    dtype="float32",
    num_threads=1,
    log_level="warning",
    tp_size=2,
    random_seed=7,
    test_mode=True,  # the ranks compare their schedulers after every step
)
CASES = {
    "radix-overlap": dict(
        max_total_tokens=4096, cpu_forward_stream="thread"
    ),  # the forward on its own thread
    "no-radix": dict(max_total_tokens=4096, disable_radix_cache=True),
    "no-overlap": dict(max_total_tokens=4096, disable_overlap_schedule=True),
    # test_continuous_batching's over-admission: once the short requests finish, the next round
    # reserves only new_token_ratio of the running requests' remaining tokens and decode retracts
    "retract": dict(max_total_tokens=160, init_new_token_ratio=0.5),
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = build_tiny_model(str(tmp_path_factory.mktemp("tp-engine")))
    torch.set_num_threads(1)
    return path, load_hf_model(path)


def _prompts() -> list[list[int]]:
    rng = random.Random(4)
    system = [rng.randrange(3, 390) for _ in range(20)]
    return [system + [rng.randrange(3, 390) for _ in range(n)] for n in (3, 9, 14, 6)]


def _workload(case: str) -> tuple[list[list[int]], list[int]]:
    """Prompts and their max_new_tokens: a shared system prompt; for "retract" ~450 tokens of
    demand (12 prompts of 8 tokens, 4 or 44 new tokens) through the 160-token pool."""
    if case != "retract":
        return _prompts(), [GREEDY["max_new_tokens"]] * 4
    rng = random.Random(701)
    return [[rng.randrange(3, 390) for _ in range(8)] for _ in range(12)], [4, 44] * 6


@pytest.mark.parametrize("case", list(CASES))
def test_engine_tp2_matches_transformers(case, tiny_model):
    path, hf = tiny_model
    prompts, max_new = _workload(case)
    expected = [hf_greedy(hf, [p], n)[0] for p, n in zip(prompts, max_new)]
    params = [dict(GREEDY, max_new_tokens=n) for n in max_new]
    engine = Engine(model_path=path, **ENGINE, **CASES[case])
    try:
        for attempt in range(2):
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            assert [o["output_ids"] for o in outs] == expected, attempt
        info = engine.get_server_info()
        if case == "retract":
            assert info["num_retracted_reqs"] > 0, "demand exceeds the pool: decode must retract"
        elif case != "no-radix":
            assert info["num_cached_tokens"] > 0
    finally:
        engine.shutdown()


def test_engine_tp2_sampling_equals_tp1(tiny_model):
    """Seeded sampling: every rank draws the same token, so two ranks give one rank's tokens."""
    path, _ = tiny_model
    params = {
        "max_new_tokens": 16,
        "temperature": 0.9,
        "top_p": 0.95,
        "sampling_seed": 11,
        "ignore_eos": True,
    }
    outs = {}
    for tp in (1, 2):
        engine = Engine(model_path=path, **dict(ENGINE, tp_size=tp), max_total_tokens=4096)
        try:
            outs[tp] = [
                o["output_ids"] for o in engine.generate(input_ids=_prompts(), sampling_params=params)
            ]
        finally:
            engine.shutdown()
    assert outs[1] == outs[2]


def test_killed_rank_ends_the_engine_naming_it(tiny_model):
    path, _ = tiny_model
    engine = Engine(model_path=path, **ENGINE, max_total_tokens=4096)
    try:
        scheduler = next(p for name, p in engine.tokenizer_manager.processes if name == "scheduler")
        (rank1,) = [
            p for p in psutil.Process(scheduler.pid).children() if "scheduler_ranks" in " ".join(p.cmdline())
        ]
        os.kill(rank1.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="TP rank 1 died"):
            engine.generate(input_ids=_prompts()[0], sampling_params=GREEDY)
    finally:
        engine.shutdown()


def test_a_model_that_cannot_be_split_is_refused_at_start(tiny_model, tmp_path):
    save_tiny_model("llama", tmp_path, intermediate_size=129, vocab_size=400)
    with pytest.raises(RuntimeError, match="intermediate_size 129"):
        Engine(model_path=str(tmp_path), tokenizer_path=tiny_model[0], **ENGINE, max_total_tokens=4096)


def test_two_nodes_on_loopback_serve_http_and_a_lost_node_ends_the_other(tiny_model, tmp_path):
    """--nnodes 2: node 1 runs rank 1 only, node 0 serves; killing node 0 ends node 1 naming its rank."""
    path, hf = tiny_model
    args = [
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--tp-size",
        "2",
        "--nnodes",
        "2",
        "--dist-init-addr",
        f"127.0.0.1:{get_free_port()}",
    ]
    args += ["--num-threads", "1", "--max-total-tokens", "4096", "--log-level", "warning"]
    node1 = start_test_server(path, tmp_path / "node1.log", [*args, "--node-rank", "1"])
    node0 = None
    try:
        node0 = launch_test_server(path, tmp_path / "node0.log", [*args, "--node-rank", "0"])
        prompts = _prompts()[:2]
        for prompt, expected in zip(prompts, hf_greedy(hf, prompts, 16)):
            body = {
                "input_ids": prompt,
                "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True},
            }
            assert (
                httpx.post(node0.base_url + "/generate", json=body, timeout=300).json()["output_ids"]
                == expected
            )
        stop_test_server(node0)
        assert node1.wait(timeout=300) != 0
        assert "TP rank 1 (pid" in (tmp_path / "node1.log").read_text()
    finally:
        for proc in (node0, node1):
            if proc is not None:
                stop_test_server(proc)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_cuda_tp2_matches_transformers(tiny_model):
    path, hf = tiny_model
    prompts = _prompts()
    expected = hf_greedy(hf, prompts, GREEDY["max_new_tokens"])
    engine = Engine(model_path=path, device="cuda", dtype="float32", tp_size=2, log_level="warning")
    try:
        outs = engine.generate(input_ids=prompts, sampling_params=[GREEDY] * len(prompts))
        assert [o["output_ids"] for o in outs] == expected
    finally:
        engine.shutdown()
