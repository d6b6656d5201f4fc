"""The LoRA flags and names: --lora-paths' three forms, the refusals naming the flag, and the
front end's registry (names, requests in flight, waiting for an unload)."""

from __future__ import annotations

import asyncio

import pytest

from radixengine.lora.lora_registry import LoRARef, LoRARegistry, UnknownLoRAError, parse_lora_paths
from radixengine.server_args import ServerArgs


def test_lora_paths_forms():
    refs = parse_lora_paths(
        ["/x/plain", "named=/x/y", '{"lora_name": "p", "lora_path": "/x/z", "pinned": true}']
    )
    assert [(r.lora_name, r.lora_path, r.pinned) for r in refs] == [
        ("/x/plain", "/x/plain", False),
        ("named", "/x/y", False),
        ("p", "/x/z", True),
    ]
    # The same flags give the same ids in every process that parses them.
    assert [r.lora_id for r in refs] == [
        r.lora_id
        for r in parse_lora_paths(
            ["/x/plain", "named=/x/y", '{"lora_name": "p", "lora_path": "/x/z", "pinned": true}']
        )
    ]


def test_lora_paths_turn_lora_on():
    args = ServerArgs(model_path="unused", lora_paths=["a=/x"])
    assert args.enable_lora and args.max_loras_per_batch == 8 and args.lora_eviction_policy == "lru"


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(lora_paths=["a=/x", "a=/y"]), "appear more than once"),
        (dict(lora_paths=['{"lora_name": "a"}']), "must have lora_path"),
        (dict(lora_paths=["=/x"]), "PATH, NAME=PATH or JSON"),
        (dict(enable_lora=True, max_loras_per_batch=0), "--max-loras-per-batch must be a positive integer"),
        (dict(enable_lora=True, max_lora_rank=-1), "--max-lora-rank must be a positive integer"),
        (dict(lora_paths=["a=/x", "b=/y"], max_loaded_loras=1), "more than --max-loaded-loras 1"),
        (
            dict(enable_lora=True, lora_eviction_policy="random"),
            "--lora-eviction-policy must be one of lru, fifo",
        ),
        (
            dict(enable_lora=True, lora_target_modules=["embed_tokens"]),
            "--lora-target-modules: ['embed_tokens']",
        ),
        (
            dict(enable_lora=True, speculative_algorithm="NGRAM"),
            "--enable-lora cannot be used with --speculative",
        ),
    ],
)
def test_bad_lora_flags_are_refused_naming_them(kwargs, needle):
    with pytest.raises(ValueError) as e:
        ServerArgs(model_path="unused", **kwargs)
    assert needle in str(e.value)


def test_registry_resolves_counts_and_waits_for_unload():
    async def scenario():
        ref = LoRARef("a", "/x")
        registry = LoRARegistry([ref])
        assert registry.resolve("a") is ref
        with pytest.raises(UnknownLoRAError, match="'b' is not loaded"):
            registry.resolve("b")
        registry.acquire(ref.lora_id)
        registry.acquire(ref.lora_id)
        assert registry.unregister("a") is ref and "a" not in registry
        waiter = asyncio.ensure_future(registry.wait_idle(ref.lora_id))
        registry.release(ref.lora_id)
        await asyncio.sleep(0)
        assert not waiter.done()  # one request still in flight
        registry.release(ref.lora_id)
        await asyncio.wait_for(waiter, 1)

    asyncio.run(scenario())
