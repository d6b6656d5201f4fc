"""The hierarchical cache's flags (server_args_hicache.py): SGLang's names on the command line and
as Engine keywords, and the combinations refused at start with the reason."""

from __future__ import annotations

import argparse
import logging

import pytest

from radixengine.managers.metrics import TokenizerMetricsCollector
from radixengine.server_args import ServerArgs
from radixengine.server_args_hicache import resolve_storage_dir, resolve_storage_max_bytes

STORAGE = dict(enable_hierarchical_cache=True, hicache_storage_backend="file")


def test_flags_parse_with_sglang_names():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(
        "--device cpu --enable-hierarchical-cache --hicache-storage-backend file --hicache-storage-dir /x "
        "--hicache-write-policy write_back --hicache-storage-prefetch-policy timeout "
        "--hicache-ratio 3 --hicache-storage-max-bytes 1000".split()
    )
    args = ServerArgs.from_cli_args(ns)
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "file"
    assert (args.hicache_write_policy, args.hicache_storage_prefetch_policy) == ("write_back", "timeout")
    assert (args.hicache_storage_dir, args.hicache_ratio, args.hicache_storage_max_bytes) == ("/x", 3.0, 1000)
    with pytest.raises(SystemExit):
        parser.parse_args(["--hicache-write-policy", "sometimes"])


def test_defaults_follow_sglang():
    args = ServerArgs(device="cpu")
    assert args.enable_hierarchical_cache is False
    assert args.hicache_ratio == 2.0 and args.hicache_size == 0
    assert args.hicache_write_policy == "write_through"
    assert args.hicache_storage_prefetch_policy == "best_effort"
    assert args.hicache_storage_backend is None


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({"hicache_storage_backend": "file"}, "needs --enable-hierarchical-cache"),
        ({**STORAGE, "disable_radix_cache": True}, "--disable-radix-cache"),
        ({"enable_hierarchical_cache": True}, "add --hicache-storage-backend file"),
        ({**STORAGE, "hicache_size": 4}, "no host tier"),
        ({**STORAGE, "hicache_ratio": 0}, "--hicache-ratio"),
        ({**STORAGE, "hicache_write_policy": "write_sometimes"}, "--hicache-write-policy"),
        ({**STORAGE, "hicache_storage_prefetch_policy": "never"}, "--hicache-storage-prefetch-policy"),
        ({"enable_hierarchical_cache": True, "hicache_storage_backend": "s3"}, "--hicache-storage-backend"),
        ({**STORAGE, "hicache_storage_max_bytes": -1}, "--hicache-storage-max-bytes"),
    ],
)
def test_unusable_combinations_are_refused_with_the_reason(kwargs, reason):
    with pytest.raises(ValueError, match=reason):
        ServerArgs(device="cpu", **kwargs)


def test_the_folder_and_its_bound_come_from_sglang_variables(monkeypatch):
    args = ServerArgs(device="cpu", **STORAGE)
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE", raising=False)
    assert resolve_storage_dir(args) == "/tmp/hicache" and resolve_storage_max_bytes(args) == 8 << 30
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", "/data/kv")
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE", "5000")
    assert resolve_storage_dir(args) == "/data/kv" and resolve_storage_max_bytes(args) == 5000
    flagged = ServerArgs(device="cpu", hicache_storage_dir="/mine", hicache_storage_max_bytes=7, **STORAGE)
    assert resolve_storage_dir(flagged) == "/mine" and resolve_storage_max_bytes(flagged) == 7
    unbounded = ServerArgs(device="cpu", hicache_storage_max_bytes=0, **STORAGE)
    assert resolve_storage_max_bytes(unbounded) == 0  # explicitly: no bound, over the variable


def test_metrics_count_storage_tokens_apart():
    metrics = TokenizerMetricsCollector("hicache-metrics")
    meta = {
        "finish_reason": {"type": "length", "length": 3},
        "prompt_tokens": 300,
        "completion_tokens": 3,
        "cached_tokens": 256,
        "cached_tokens_details": {"device": 64, "host": 0, "storage": 192},
    }
    metrics.observe_finished(meta, created=0.0, now=1.0)
    samples = {
        s.labels.get("cache_source"): s.value
        for m in metrics.registry.collect()
        for s in m.samples
        if s.name == "sglang:cached_tokens_total"
    }
    assert samples == {"device": 64, "storage": 192}


def test_host_tier_sizes_that_do_nothing_are_named(caplog):
    with caplog.at_level(logging.WARNING, "radixengine.server_args_hicache"):
        ServerArgs(device="cpu", hicache_ratio=3)
        ServerArgs(device="cpu", **STORAGE, hicache_ratio=3)
    assert "do nothing without --enable-hierarchical-cache" in caplog.text
    assert "on a CPU there is no host tier" in caplog.text
