"""LoRA with the hierarchical cache through the scheduler: two adapters and the base model given
the same long prompt, whose prefixes a small KV pool evicts to the host tier and/or storage and
reads back, get the greedy tokens of the same requests without the hierarchical cache; each
namespace's prefix comes back to it alone, also from storage after a restart (an adapter's
pages are keyed by its weights)."""

from __future__ import annotations

import pytest
from sched_utils import random_prompts
from test_lora_scheduler import lora_req, make_lora_scheduler, run

PROMPT = random_prompts(41, 1, 150, 150)[0]
FILLER = random_prompts(42, 2, 200, 200)  # the base model's: pushes PROMPT's prefixes out of the pool
NAMES = ("a", "b", None)
POOL = 512
TIERS = {
    "host": dict(hicache_host_tier_on_cpu=True, hicache_ratio=4),
    "storage": dict(hicache_storage_backend="file"),
    "host+storage": dict(hicache_host_tier_on_cpu=True, hicache_ratio=1, hicache_storage_backend="file"),
}


def phases(sched, tag: str) -> dict[str, dict]:
    """PROMPT under every namespace, the filler, PROMPT under every namespace again (each after
    the pages of the one before are written: what the prefetches find does not depend on time)."""
    first = run(sched, [lora_req(f"{tag}1{n}", PROMPT, n, 8, False) for n in NAMES])
    flush(sched)
    run(sched, [lora_req(f"{tag}f{i}", p, None, 4, False) for i, p in enumerate(FILLER)])
    flush(sched)
    assert len(sched.tree_cache.match_prefix(PROMPT[:-1], None).device_indices) < 128  # evicted
    again = run(sched, [lora_req(f"{tag}3{n}", PROMPT, n, 8, False) for n in NAMES])
    return {rid[len(tag) :]: r for rid, r in {**first, **again}.items()}


def hicache_scheduler(page_size: int, tier: str, folder):
    args = dict(
        enable_hierarchical_cache=True, hicache_storage_prefetch_policy="wait_complete", **TIERS[tier]
    )
    if "storage" in tier:
        args["hicache_storage_dir"] = str(folder)
    sched = make_lora_scheduler(page_size, POOL, **args)
    if hasattr(sched.tree_cache, "prefetch_timeout_s"):
        sched.tree_cache.prefetch_timeout_s = 3600.0  # wait_complete waits for every page, however slow
    return sched


def flush(sched) -> None:
    if hasattr(sched.tree_cache, "flush_storage"):
        sched.tree_cache.flush_storage()


def close(sched) -> None:
    flush(sched)
    sched.close()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("tier", list(TIERS))
def test_adapters_read_their_own_prefixes_back(tmp_path, tier, page_size):
    plain = make_lora_scheduler(page_size, POOL)
    expected = phases(plain, "p")
    plain.close()
    tokens = {n: expected[f"1{n}"]["ids"] for n in NAMES}
    assert tokens["a"] != tokens[None] and tokens["b"] != tokens[None] and tokens["a"] != tokens["b"]

    sched = hicache_scheduler(page_size, tier, tmp_path)
    got = phases(sched, "h")
    for key, r in expected.items():
        assert got[key]["ids"] == r["ids"], (
            f"{key}: tokens differ from the run without the hierarchical cache"
        )
    stats = sched.tree_cache.tier_stats()
    loaded = stats.get("host_tokens_loaded", 0) + stats.get("storage_hit_tokens", 0)
    prefix = (len(PROMPT) - 1) // 16 * 16
    assert loaded >= len(NAMES) * prefix  # every namespace's prefix came back from a lower tier
    for n in NAMES:
        assert got[f"3{n}"]["cached"] >= prefix > expected[f"3{n}"]["cached"]
    close(sched)

    if "storage" not in tier:
        return
    # A restart over the same folder: every namespace's pages are read (an adapter's are keyed
    # by its weights), each by its own namespace.
    restarted = hicache_scheduler(page_size, tier, tmp_path)
    out = run(restarted, [lora_req(f"r{n}", PROMPT, n, 8, False) for n in NAMES])
    for n in NAMES:
        assert out[f"r{n}"]["ids"] == tokens[n]
        assert out[f"r{n}"]["cached"] >= prefix
    assert restarted.tree_cache.storage_hit_tokens >= len(NAMES) * prefix
    close(restarted)
