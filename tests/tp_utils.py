"""Running a ModelRunner split over tensor-parallel ranks: one spawned process per rank, gloo on
the CPU, one thread each; greedy decoding through `ModelDriver` as in model_utils."""

from __future__ import annotations

import multiprocessing as mp
import traceback

import torch
from model_utils import ModelDriver, make_runner

from radixengine.utils.network import get_free_port

RESULT_TIMEOUT_S = 600.0  # a guard against a hung rank, never reached by a passing run


def greedy_tokens(runner, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Each prompt decoded greedily on its own, its pool rows freed after."""
    driver = ModelDriver(runner)
    outs = []
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        logits = driver.extend({rid: prompt})
        tokens: list[int] = []
        while True:
            tokens.append(int(logits[0].argmax()))
            if len(tokens) == max_new:
                break
            logits = driver.decode({rid: tokens[-1]})
        driver.free(rid)
        outs.append(tokens)
    return outs


def block_modules(runner) -> int:
    """Modules that keep GGUF blocks."""
    return sum(getattr(m, "block_weight", None) is not None for m in runner.model.modules())


def _rank_main(rank, tp_size, port, runs, prompts, max_new, results) -> None:
    from radixengine.distributed import destroy_distributed, init_distributed

    try:
        torch.set_num_threads(1)
        init_distributed(tp_size, rank, f"tcp://127.0.0.1:{port}", timeout_s=RESULT_TIMEOUT_S)
        out = []
        for path, kwargs in runs:
            runner = make_runner(path, **kwargs)
            out.append((runner.num_kv_heads, greedy_tokens(runner, prompts, max_new), block_modules(runner)))
        results.put((rank, out, None))
        destroy_distributed()
    except BaseException:
        results.put((rank, None, traceback.format_exc()))


def tp_greedy(
    runs: list[tuple[str, dict]], tp_size: int, prompts: list[list[int]], max_new: int
) -> dict[int, list[tuple]]:
    """`{rank: [(its key/value heads, its greedy tokens per prompt, its GGUF block modules)]}`,
    one entry per run (a model path and `make_runner` arguments), all run by one set of rank
    processes; raises a rank's error."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = get_free_port()
    procs = [
        ctx.Process(
            target=_rank_main, args=(rank, tp_size, port, runs, prompts, max_new, results), daemon=True
        )
        for rank in range(tp_size)
    ]
    for proc in procs:
        proc.start()
    try:
        out = {}
        for _ in procs:
            rank, models, error = results.get(timeout=RESULT_TIMEOUT_S)
            if error is not None:
                raise RuntimeError(f"TP rank {rank} failed:\n{error}")
            out[rank] = models
        return out
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
