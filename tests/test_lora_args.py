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
    ],
)
def test_bad_lora_flags_are_refused_naming_them(kwargs, needle):
    with pytest.raises(ValueError) as e:
        ServerArgs(model_path="unused", **kwargs)
    assert needle in str(e.value)


@pytest.mark.parametrize("tier", [dict(hicache_storage_backend="file"), dict(hicache_host_tier_on_cpu=True)])
def test_lora_serves_with_the_hierarchical_cache(tmp_path, tier):
    # Its tiers keep each adapter's KV in the adapter's namespace (tests/test_hicache_lora*.py).
    args = ServerArgs(
        model_path="unused",
        device="cpu",
        lora_paths=["a=/x"],
        enable_hierarchical_cache=True,
        hicache_storage_dir=str(tmp_path),
        **tier,
    )
    assert args.enable_lora and args.enable_hierarchical_cache


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
        assert registry.was_unloaded("a") and not registry.was_unloaded("b")
        with pytest.raises(UnknownLoRAError, match="'a' was unloaded"):
            registry.resolve("a")
        waiter = asyncio.ensure_future(registry.wait_idle(ref.lora_id))
        registry.release(ref.lora_id)
        await asyncio.sleep(0)
        assert not waiter.done()  # one request still in flight
        registry.release(ref.lora_id)
        await asyncio.wait_for(waiter, 1)
        registry.register(LoRARef("a", "/y"))  # loaded again: resolves, no longer "unloaded"
        assert not registry.was_unloaded("a") and registry.resolve("a").lora_path == "/y"

    asyncio.run(scenario())


def _adapter(rank: int, value: float):
    import torch

    from radixengine.lora.lora_adapter import LoRAAdapter, weights_digest
    from radixengine.lora.lora_config import LoRAConfig

    config = LoRAConfig("/x", rank, float(rank), ("o_proj",))
    weights = {(0, "o_proj"): (torch.full((rank, 1, 4), value), torch.full((rank, 1, 4), value))}
    return LoRAAdapter(config, weights, weights_digest(weights))


@pytest.mark.parametrize("policy, victim", [("lru", "b"), ("fifo", "a")])
def test_pool_evicts_by_policy_and_never_a_pinned_or_used_slot(policy, victim):
    import torch

    from radixengine.lora.lora_adapter import ModuleShape
    from radixengine.lora.mem_pool import LoRAMemoryPool

    pool = LoRAMemoryPool({(0, "o_proj"): ModuleShape(4, (4,))}, 3, 4, policy, torch.float32, "cpu")
    ad = {name: _adapter(2 + i % 2, float(i + 1)) for i, name in enumerate("abcde")}
    pool.prepare({"p": ad["e"]}, pinned={"p"})  # pinned: in every batch, never evicted
    pool.prepare({"a": ad["a"], "p": ad["e"]}, {"p"})
    pool.prepare({"b": ad["b"], "p": ad["e"]}, {"p"})
    pool.prepare({"a": ad["a"], "p": ad["e"]}, {"p"})  # a used again: lru keeps it, fifo does not
    slots = pool.prepare({"c": ad["c"], "p": ad["e"]}, {"p"})
    assert set(pool.slot_of) == {"p", "c", "a" if victim == "b" else "b"}
    a_buf, b_buf = pool.buffers[(0, "o_proj")]
    c = slots["c"]
    assert pool.rank_of(c) == ad["c"].rank
    assert torch.equal(a_buf[c, : ad["c"].rank], ad["c"].weights[(0, "o_proj")][0])
    assert not a_buf[c, ad["c"].rank :].any()  # a lower rank than the slot's last adapter: zeros after it
    with pytest.raises(RuntimeError, match="more than the pool's 3 slots"):
        pool.prepare({k: ad[k] for k in "abcd"}, {"p"})
    pool.drop("c")
    assert "c" not in pool.slot_of


def test_adapter_digest_names_its_weights():
    # The hierarchical cache keys an adapter's storage pages by it (docs/lora.md).
    assert _adapter(2, 1.0).digest == _adapter(2, 1.0).digest
    assert len({_adapter(2, 1.0).digest, _adapter(2, 2.0).digest, _adapter(3, 1.0).digest}) == 3


def test_no_adapter_takes_the_served_model_name():
    """A `model` naming the served model means the base model, so no adapter may take the name:
    refused at start (here) and at /load_lora_adapter (tests/test_lora_http.py)."""
    from types import SimpleNamespace

    from radixengine.managers.tokenizer_lora import TokenizerLoRA

    args = SimpleNamespace(enable_lora=True, lora_paths=["base=/x", "a=/y"])
    with pytest.raises(ValueError, match="'base', as the served model is"):
        TokenizerLoRA(args, None, "base")
    assert TokenizerLoRA(args, None, "other").served_model_name == "other"
