"""The hierarchical cache in a real Engine: across a restart a new Engine (new scheduler process)
on the same folder reads the prompt's KV from the files the first one wrote, with the same
greedy tokens, and says so in meta_info (`cached_tokens_details`); pages queued at shutdown are
written; the host tier (on a CPU with its test flag) brings an evicted prompt back."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from test_engine_utils import build_tiny_model, hf_greedy, load_hf_model

from radixengine import Engine
from radixengine.mem_cache.storage.policies import FILE_BACKEND_DIR_ENV

MAX_NEW = 8
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
PROMPT_IDS = [(i * 37 + 11) % 250 + 3 for i in range(200)]


def _engine(model_path: str, **kw) -> Engine:
    args = dict(
        model_path=model_path,
        dtype="float32",
        max_total_tokens=2048,
        num_threads=1,
        log_level="warning",
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_prefetch_policy="wait_complete",
    )
    return Engine(**{**args, **kw})


def _wait_for_pages(folder: Path, count: int, timeout: float = 120.0) -> None:
    """The writer thread writes after the request finished; wait until its pages are there."""
    deadline = time.monotonic() + timeout
    while len(list(folder.glob("*/*.kv"))) < count:
        assert time.monotonic() < deadline, f"pages not written to {folder}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_llama_hicache")))


def test_restarted_engine_reads_the_prompt_from_storage(model_path, tmp_path, monkeypatch):
    with _engine(model_path, hicache_storage_dir=str(tmp_path)) as first:
        cold = first.generate(input_ids=PROMPT_IDS, sampling_params=GREEDY)
        _wait_for_pages(tmp_path, 12)
    assert cold["meta_info"]["cached_tokens"] == 0
    assert cold["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": 0}

    monkeypatch.setenv(FILE_BACKEND_DIR_ENV, str(tmp_path))  # SGLang's variable names the folder
    with _engine(model_path) as second:
        warm = second.generate(input_ids=PROMPT_IDS, sampling_params=GREEDY)
        again = second.generate(input_ids=PROMPT_IDS, sampling_params=GREEDY)
    assert warm["meta_info"]["cached_tokens"] == 192  # twelve 16-token pages of the 199 matchable
    assert warm["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": 192}
    assert again["meta_info"]["cached_tokens_details"]["storage"] == 0  # now in the tree
    assert warm["output_ids"] == cold["output_ids"] == again["output_ids"]
    hf = load_hf_model(model_path, dtype=torch.float32)
    assert warm["output_ids"] == hf_greedy(hf, [PROMPT_IDS], MAX_NEW)[0]


def test_engine_refuses_storage_without_the_radix_cache(model_path, tmp_path):
    with pytest.raises(ValueError, match="disable-radix-cache"):
        _engine(model_path, hicache_storage_dir=str(tmp_path), disable_radix_cache=True)


@pytest.mark.slow
def test_smollm2_system_prompt_from_storage_after_restart(tmp_path):
    from radixengine.model_loader import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    system = "You are a careful assistant for a hardware shop. " * 12
    chats = [
        [{"role": "system", "content": system}, {"role": "user", "content": q}] for q in ("Hi!", "Price?")
    ]
    params = {"max_new_tokens": 12, "temperature": 0}
    kw = dict(
        dtype="float32",
        log_level="warning",
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path),
        hicache_storage_prefetch_policy="wait_complete",
    )
    with Engine(**kw) as first:
        cold = first.chat(chats, params)
        _wait_for_pages(tmp_path, 8)
    with Engine(**kw) as second:
        warm = second.chat(chats, params)
    assert [o["output_ids"] for o in warm] == [o["output_ids"] for o in cold]
    # Whichever chat the scheduler admits first loads the system prompt from storage (the two
    # arrive together, in either order); the other finds it on the device.
    details = [o["meta_info"]["cached_tokens_details"] for o in warm]
    assert max(d["storage"] for d in details) >= 128
    assert all(d["storage"] + d["device"] >= 128 for d in details)


def test_pages_queued_at_shutdown_are_written(model_path, tmp_path):
    """Engine.shutdown SIGTERMs the scheduler right after the last answer: the storage writer's
    queue is drained (bounded by SHUTDOWN_DRAIN_S) before the process exits, not dropped."""
    prompts = [[(i * 31 + k * 7) % 250 + 3 for i in range(960)] for k in range(16)]
    params = {"max_new_tokens": 1, "temperature": 0}
    with _engine(model_path, hicache_storage_dir=str(tmp_path), max_total_tokens=16384) as engine:
        engine.generate(input_ids=prompts, sampling_params=params)
    # No waiting: the files are there when shutdown returns. Each request's 960 tokens with KV
    # (the prompt; its one output token has none) fill 60 whole 16-token pages.
    assert len(list(tmp_path.glob("*/*.kv"))) == 16 * 60


def test_host_tier_through_the_engine(model_path):
    """--hicache-host-tier-on-cpu in a real engine: a prompt evicted by others comes back from the
    host pool (`cached_tokens_details.host`), with transformers' greedy tokens."""
    others = [[(i * 13 + k * 29) % 250 + 3 for i in range(200)] for k in range(3)]
    kw = dict(hicache_storage_backend=None, hicache_host_tier_on_cpu=True, max_total_tokens=512)
    with _engine(model_path, **kw) as engine:
        cold = engine.generate(input_ids=PROMPT_IDS, sampling_params=GREEDY)
        for ids in others:
            engine.generate(input_ids=ids, sampling_params=GREEDY)
        warm = engine.generate(input_ids=PROMPT_IDS, sampling_params=GREEDY)
        info = engine.get_server_info()
    assert warm["meta_info"]["cached_tokens_details"]["host"] == warm["meta_info"]["cached_tokens"] >= 192
    assert warm["output_ids"] == cold["output_ids"]
    hf = load_hf_model(model_path, dtype=torch.float32)
    assert warm["output_ids"] == hf_greedy(hf, [PROMPT_IDS], MAX_NEW)[0]
    assert info["host_pool_size"] == 1024 and info["host_tokens_loaded"] >= 192  # /get_server_info


def test_speculation_with_the_host_and_storage_tiers(model_path, tmp_path):
    """NGRAM speculation under the overlap loop beside both tiers: a prompt evicted to the host
    pool comes back and verify steps run on top of its loaded KV, with transformers' tokens."""
    pattern = [(i * 7 + 5) % 250 + 3 for i in range(40)]
    prompt = pattern * 5  # repeats: the n-gram index drafts its continuation
    others = [[(i * 13 + k * 29) % 250 + 3 for i in range(200)] for k in range(3)]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    kw = dict(
        hicache_storage_dir=str(tmp_path),
        hicache_host_tier_on_cpu=True,
        max_total_tokens=512,
        speculative_algorithm="NGRAM",
    )
    with _engine(model_path, **kw) as engine:
        assert not engine.get_server_info()["disable_overlap_schedule"]
        cold = engine.generate(input_ids=prompt, sampling_params=params)
        for ids in others:
            engine.generate(input_ids=ids, sampling_params=GREEDY)
        warm = engine.generate(input_ids=prompt, sampling_params=params)
    details = warm["meta_info"]["cached_tokens_details"]
    assert details["host"] + details["storage"] == warm["meta_info"]["cached_tokens"] >= 192
    assert cold["meta_info"]["spec_verify_ct"] > 0 and warm["meta_info"]["spec_verify_ct"] > 0
    hf = load_hf_model(model_path, dtype=torch.float32)
    assert warm["output_ids"] == cold["output_ids"] == hf_greedy(hf, [prompt], 24)[0]


def test_page_files_of_another_dtype_are_recomputed_and_the_engine_serves_on(model_path, tmp_path):
    """Every page file rewritten as bfloat16 with a valid checksum (a header that lies about the
    model's KV dtype): the restarted engine recomputes, answers the same tokens, and serves on."""
    from test_hicache_storage import as_bfloat16, rewrite_page

    with _engine(model_path, hicache_storage_dir=str(tmp_path)) as first:
        cold = first.generate(input_ids=PROMPT_IDS, sampling_params=GREEDY)
        _wait_for_pages(tmp_path, 12)
    for path in tmp_path.glob("*/*.kv"):
        rewrite_page(path, lambda h: {**h, "dtype": "bfloat16"}, as_bfloat16)
    with _engine(model_path, hicache_storage_dir=str(tmp_path)) as second:
        warm = second.generate(input_ids=PROMPT_IDS, sampling_params=GREEDY)
        again = second.generate(input_ids=PROMPT_IDS[:100], sampling_params=GREEDY)
        assert second.get_server_info()["num_running_reqs"] == 0
    assert warm["output_ids"] == cold["output_ids"]
    assert warm["meta_info"]["cached_tokens_details"]["storage"] == 0
    assert again["meta_info"]["cached_tokens"] > 0  # from the tree the first request filled
