"""The storage tier under tensor parallelism (--tp-size 2, gloo on the CPU): each rank writes its
own heads' pages (a subfolder of its own), and after a restart the ranks admit a request and
load its pages together — the pages every rank has — with the ranks' schedulers compared after
every step (--test-mode). The base model's and a LoRA adapter's prompts come back from storage
with one rank's tokens; with one rank's pages gone, none are loaded and the tokens stay."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from lora_utils import save_random_adapter
from test_engine_utils import build_tiny_model, wait_for_idle_accounting

from radixengine import Engine

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
PROMPT = [(i * 37 + 11) % 250 + 3 for i in range(200)]
PAGES_PER_PROMPT = 12  # whole 16-token pages of the 199 matchable tokens
NAMES = [None, "a"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    base = build_tiny_model(str(tmp_path_factory.mktemp("base")))
    return base, str(save_random_adapter(Path(base), tmp_path_factory.mktemp("a"), seed=3))


def _engine(models, tp_size: int, folder: Path | None) -> Engine:
    base, adapter = models
    storage = dict(
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(folder),
        hicache_storage_prefetch_policy="wait_complete",
    )
    return Engine(
        model_path=base,
        tp_size=tp_size,
        device="cpu",
        dtype="float32",
        num_threads=1,
        log_level="warning",
        max_total_tokens=2048,
        lora_paths=[f"a={adapter}"],
        test_mode=True,
        watchdog_timeout=120,
        **(storage if folder is not None else {}),
    )


def _run(engine: Engine) -> list[dict]:
    outs = engine.generate(input_ids=[PROMPT, PROMPT], sampling_params=GREEDY, lora_path=NAMES)
    wait_for_idle_accounting(engine.get_server_info, 20.0)
    return outs


def _pages(folder: Path) -> list[Path]:
    return list(folder.glob("*/*.kv"))


def _wait_for_pages(folder: Path, count: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while len(_pages(folder)) < count:
        assert time.monotonic() < deadline, f"{len(_pages(folder))} of {count} pages written to {folder}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def one_rank(models) -> list[list[int]]:
    engine = _engine(models, 1, None)
    try:
        return [o["output_ids"] for o in _run(engine)]
    finally:
        engine.shutdown()


def _cold_then_warm(models, folder: Path, between=None) -> tuple[list[dict], list[dict]]:
    engine = _engine(models, 2, folder)
    try:
        cold = _run(engine)
        _wait_for_pages(folder, 2 * 2 * PAGES_PER_PROMPT)  # 2 ranks x 2 namespaces
    finally:
        engine.shutdown()
    assert len([d for d in folder.iterdir() if d.is_dir()]) == 2, "a subfolder per rank"
    if between is not None:
        between(folder)
    engine = _engine(models, 2, folder)  # a restart: only storage holds the prompts
    try:
        return cold, _run(engine)
    finally:
        engine.shutdown()


def test_both_ranks_read_their_pages_after_a_restart(models, one_rank, tmp_path):
    cold, warm = _cold_then_warm(models, tmp_path)
    assert [o["meta_info"]["cached_tokens"] for o in cold] == [0, 0]
    details = [o["meta_info"]["cached_tokens_details"] for o in warm]
    assert details == [{"device": 0, "host": 0, "storage": 16 * PAGES_PER_PROMPT}] * 2
    assert [o["output_ids"] for o in cold] == [o["output_ids"] for o in warm] == one_rank
    assert one_rank[0] != one_rank[1]  # the adapter's prompt is its own


def test_pages_one_rank_lacks_are_loaded_by_no_rank(models, one_rank, tmp_path):
    def drop_one_ranks_pages(folder: Path) -> None:
        shutil.rmtree(sorted(d for d in folder.iterdir() if d.is_dir())[0])

    _, warm = _cold_then_warm(models, tmp_path, drop_one_ranks_pages)
    assert [o["meta_info"]["cached_tokens"] for o in warm] == [0, 0]
    assert [o["output_ids"] for o in warm] == one_rank
