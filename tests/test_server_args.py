import argparse

import pytest
import torch

from radixengine.server_args import ServerArgs


def test_defaults_follow_sglang():
    args = ServerArgs()
    assert args.schedule_policy == "fcfs"
    assert args.page_size == 1
    assert args.max_prefill_tokens == 16384
    assert args.priority_scheduling_preemption_threshold == 10
    assert args.lpm_fallback_queue_len == 128
    assert args.disable_overlap_schedule is False
    assert args.init_ratio == pytest.approx(0.7)
    assert args.min_ratio == pytest.approx(0.098)
    assert args.ratio_decay == pytest.approx((0.7 - 0.098) / 600)


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"schedule_policy": "sjf"}, "--schedule-policy"),
        ({"page_size": 0}, "--page-size"),
        ({"max_total_tokens": -5}, "--max-total-tokens"),
        ({"chunked_prefill_size": 30, "page_size": 16}, "--chunked-prefill-size"),
        ({"dtype": "int3"}, "--dtype"),
        ({"port": 70000}, "--port"),
        ({"init_new_token_ratio": 0.0}, "--init-new-token-ratio"),
        ({"cpu_forward_stream": "fibers"}, "--cpu-forward-stream"),
    ],
)
def test_bad_values_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        ServerArgs(**kwargs)


def test_unknown_kwarg_is_rejected():
    with pytest.raises(TypeError, match="max_batch"):
        ServerArgs.from_kwargs(max_batch=3)


def test_cli_round_trip():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(
        [
            "--schedule-policy",
            "lpm",
            "--disable-radix-cache",
            "--page-size",
            "16",
            "--max-total-tokens",
            "4096",
            "--device",
            "cpu",
        ]
    )
    args = ServerArgs.from_cli_args(ns)
    assert (args.schedule_policy, args.disable_radix_cache, args.page_size) == ("lpm", True, 16)
    assert args.max_total_tokens == 4096
    assert args.effective_chunked_prefill_size == 2048


def test_cpu_forward_stream_flag(capsys):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert ServerArgs.from_cli_args(parser.parse_args([])).cpu_forward_stream == "auto"
    for layout in ("thread", "inline"):
        assert (
            ServerArgs.from_cli_args(parser.parse_args(["--cpu-forward-stream", layout])).cpu_forward_stream
            == layout
        )
    with pytest.raises(SystemExit):
        parser.parse_args(["--cpu-forward-stream", "fibers"])
    assert "invalid choice: 'fibers'" in capsys.readouterr().err
    help_text = " ".join(parser.format_help().split())
    assert "--cpu-forward-stream {auto,thread,inline}" in help_text and "worker thread" in help_text
    with pytest.raises(
        ValueError, match="--cpu-forward-stream must be one of auto, thread, inline; got 'Thread'"
    ):
        ServerArgs(cpu_forward_stream="Thread")


def test_chunked_prefill_can_be_disabled():
    assert ServerArgs(chunked_prefill_size=-1).effective_chunked_prefill_size is None


def test_kv_cache_dtype_choices_and_device():
    assert ServerArgs(kv_cache_dtype="float16", device="cpu").kv_cache_dtype == "float16"
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        ServerArgs(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="CPU only"):
        ServerArgs(kv_cache_dtype="bfloat16", device="cuda")


def test_kv_cache_dtype_resolution():
    from radixengine.model_executor.model_runner import resolve_kv_cache_dtype

    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("float16", torch.float32) == torch.float16
    assert resolve_kv_cache_dtype("bfloat16", torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="needs a float32 model"):
        resolve_kv_cache_dtype("float16", torch.bfloat16)


def test_fair_scheduling_flags_parse():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    defaults = ServerArgs.from_cli_args(parser.parse_args(["--device", "cpu"]))
    assert (defaults.lpm_aging_tokens_per_pass, defaults.dlpm_quantum_tokens) == (0, 2048)
    assert (defaults.retraction_policy, defaults.radix_eviction_policy) == ("length", "lru")
    for policy in ("hrrn", "shortest-prefill-first", "dlpm"):
        assert (
            ServerArgs.from_cli_args(parser.parse_args(["--schedule-policy", policy])).schedule_policy
            == policy
        )
    args = ServerArgs.from_cli_args(
        parser.parse_args(
            [
                "--schedule-policy",
                "lpm",
                "--lpm-aging-tokens-per-pass",
                "16",
                "--dlpm-quantum-tokens",
                "1024",
                "--retraction-policy",
                "priority",
                "--enable-priority-scheduling",
                "--radix-eviction-policy",
                "slru",
                "--soft-priority-preemption",
            ]
        )
    )
    assert (args.lpm_aging_tokens_per_pass, args.dlpm_quantum_tokens) == (16, 1024)
    assert (args.retraction_policy, args.radix_eviction_policy) == ("priority", "slru")
    assert args.soft_priority_preemption and not defaults.soft_priority_preemption
    for flag, bad in (("--retraction-policy", "random"), ("--radix-eviction-policy", "mru")):
        with pytest.raises(SystemExit):
            parser.parse_args([flag, bad])
    help_text = " ".join(parser.format_help().split())
    assert "--radix-eviction-policy {lru,lfu,slru,priority}" in help_text
    assert "--retraction-policy {length,priority}" in help_text


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lpm_aging_tokens_per_pass": -1}, "--lpm-aging-tokens-per-pass must be an integer >= 0"),
        ({"lpm_aging_tokens_per_pass": 8, "schedule_policy": "fcfs"}, "ages --schedule-policy lpm only"),
        ({"dlpm_quantum_tokens": 0}, "--dlpm-quantum-tokens must be a positive integer"),
        ({"retraction_policy": "random"}, "--retraction-policy must be one of length, priority"),
        (
            {"retraction_policy": "priority"},
            "--retraction-policy priority requires --enable-priority-scheduling",
        ),
        ({"radix_eviction_policy": "mru"}, "--radix-eviction-policy must be one of lru, lfu, slru, priority"),
        (
            {"radix_eviction_policy": "priority", "schedule_low_priority_values_first": True},
            "opposite of --schedule-low-priority-values-first",
        ),
        ({"schedule_policy": "DLPM"}, "--schedule-policy must be one of .*dlpm"),
    ],
)
def test_fair_scheduling_bad_values_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(device="cpu", **kwargs)
