"""The host tier through the scheduler on a CPU (--hicache-host-tier-on-cpu): a prefix evicted
from the KV pool to the host pool comes back on a hit with the same greedy tokens as a run
without the tier (and transformers'), with and without the storage tier under it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sched_utils import (
    assert_matches_oracle,
    collect,
    gen_req,
    make_scheduler,
    random_prompts,
    run_to_completion,
)
from test_engine_utils import subprocess_env

from radixengine.managers.io_struct import BatchTokenIDOut
from radixengine.managers.metrics import SchedulerStatsCollector
from radixengine.mem_cache.host_radix_cache import HostRadixCache
from radixengine.server_args import ServerArgs

SHARED = random_prompts(11, 1, 150, 150)
PROMPTS = random_prompts(12, 3, 5, 20, shared=SHARED)
OTHER_SHARED = random_prompts(13, 1, 300, 300)
OTHER = random_prompts(14, 3, 5, 20, shared=OTHER_SHARED)
HOST = dict(enable_hierarchical_cache=True, hicache_host_tier_on_cpu=True)


def run(sched, prompts, tag: str):
    reqs = [gen_req(f"{tag}{i}", p, 8) for i, p in enumerate(prompts)]
    return reqs, run_to_completion(sched, reqs)


def outputs(results: dict, tag: str) -> list[list[int]]:
    return [results[f"{tag}{i}"].output_ids for i in range(len(results))]


def evict_and_come_back(sched, evicts: bool = True):
    """PROMPTS, then OTHER (its 300-token prefix makes the 512-token pool evict PROMPTS's),
    then PROMPTS again."""
    run(sched, PROMPTS, "a")
    run(sched, OTHER, "b")
    if evicts:
        assert sched.tree_cache.match_prefix(PROMPTS[0][:-1]).device_indices.numel() < 128
    return run(sched, PROMPTS, "c")


MATRIX = [
    pytest.param(page, kv, overlap, id=f"page{page}-{kv}-{'overlap' if overlap else 'normal'}")
    for page in (1, 16)
    for kv in ("auto", "bfloat16")
    for overlap in (False, True)
]


@pytest.mark.parametrize("page,kv,overlap", MATRIX)
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_evicted_prefix_comes_back_from_the_host(page, kv, overlap, policy):
    """The tokens of a device pool large enough to keep the prefix: the host tier brings back
    the KV the first round computed. (Against a pool that evicts and recomputes the prefix, a
    16-bit KV cache on CUDA differs: the recompute runs in another batch shape, whose GEMMs round
    differently.)"""
    opts = dict(page_size=page, kv_cache_dtype=kv, overlap=overlap)
    base = make_scheduler(**opts, max_total_tokens=4096)
    _, expected = evict_and_come_back(base, evicts=False)
    base.close()
    sched = make_scheduler(**opts, max_total_tokens=512, **HOST, hicache_write_policy=policy, hicache_ratio=4)
    assert isinstance(sched.tree_cache, HostRadixCache)
    reqs, again = evict_and_come_back(sched)
    assert outputs(again, "c") == outputs(expected, "c")
    if kv == "auto":
        assert_matches_oracle(reqs, again)
    stats = sched.tree_cache.tier_stats()
    assert stats["host_tokens_loaded"] >= 128
    prefix = (len(PROMPTS[0]) - 1) // page * page
    assert again["c0"].cached_tokens >= min(prefix, len(SHARED[0]) // page * page)
    sched.close()


FEATURES = {
    "chunked": dict(chunked_prefill_size=32),
    "slru": dict(radix_eviction_policy="slru"),
    "lfu": dict(radix_eviction_policy="lfu"),
    "leaf-tails": dict(soft_priority_preemption=True, enable_priority_scheduling=True),
}


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_host_tier_with_scheduler_features(page, feature):
    """Chunked prefill (chunks inserted through nodes on the host only), other eviction
    policies, and eviction of leaf tails, with the host tier: the same tokens as without it."""
    opts = dict(page_size=page, max_total_tokens=512, **FEATURES[feature])
    base = make_scheduler(**opts)
    _, expected = evict_and_come_back(base, evicts=False)  # leaf tails may keep most of it
    base.close()
    sched = make_scheduler(**opts, **HOST)
    reqs, again = evict_and_come_back(sched, evicts=False)
    assert outputs(again, "c") == outputs(expected, "c")
    assert_matches_oracle(reqs, again)
    assert sched.tree_cache.tier_stats()["host_tokens_loaded"] > 0
    sched.close()


def test_host_tier_and_storage_load_device_then_host_then_storage(tmp_path):
    """A host pool (160 tokens) that keeps the shared prefix but not the tail behind it: a
    request's miss is served by the host first, then by storage, then computed."""
    opts = dict(page_size=16, max_total_tokens=512)
    base = make_scheduler(**opts)
    _, expected = evict_and_come_back(base)
    base.close()
    sched = make_scheduler(
        **opts,
        **HOST,
        hicache_ratio=0.3125,
        hicache_write_policy="write_back",
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path),
        hicache_storage_prefetch_policy="wait_complete",
    )
    run(sched, PROMPTS, "a")
    run(sched, OTHER, "b")
    sched.tree_cache.flush_storage()
    reqs = [gen_req(f"c{i}", p, 8) for i, p in enumerate(PROMPTS)]
    sched.io.put(*reqs)
    sched.run_until_idle()
    messages = sched.io.take_outputs()
    again = collect(messages)
    assert outputs(again, "c") == outputs(expected, "c")
    assert_matches_oracle(reqs, again)
    final = {
        rid: (m.cached_tokens[i], m.cached_tokens_host[i], m.cached_tokens_storage[i])
        for m in messages
        if isinstance(m, BatchTokenIDOut)
        for i, rid in enumerate(m.rids)
        if m.finished_reasons[i]
    }
    # The 144-token shared prefix comes from the host once, to whichever request is admitted
    # first, then from the device; c0's 160 tokens all come from a tier, its next page from the
    # host or else from storage. Which one depends on the order in which eviction wrote pages to
    # the host pool (160 tokens), and that on the batching of OTHER, which waits on the storage
    # threads' prefetches (wait_complete): the host holds the prefix and c0's next page (c0 is
    # admitted first, with 160 from the host), or the prefix alone (c0 waits for its storage
    # prefetch: 144 from the host to another request, 16 from storage to c0).
    hosts = sorted(host for _, host, _ in final.values())
    assert hosts in ([0, 0, 144], [0, 0, 160]), final
    assert final["c0"][0] == 160, final
    assert final["c0"][2] == (16 if hosts[-1] == 144 else 0), final
    sched.close()


def test_tier_counters_in_internal_state_and_metrics(tmp_path):
    sched = make_scheduler(
        max_total_tokens=512,
        **HOST,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path),
    )
    run(sched, PROMPTS, "a")
    sched.tree_cache.flush_storage()
    state = sched.get_internal_state()
    assert state["host_pool_size"] == 1024  # --hicache-ratio 2 of 512
    assert state["host_pool_used_tokens"] == state["host_tokens_written"] > 0  # write_through
    assert state["storage_pages_written"] > 0 and state["storage_pages_queued"] == 0
    assert state["storage_write_failures"] == 0
    collector = SchedulerStatsCollector({"model_name": "m"})
    collector.update(state)
    names = {m.name: m.samples[0].value for m in collector.collect()}
    assert names["sglang:hicache_host_used_tokens"] == state["host_pool_used_tokens"]
    assert names["sglang:hicache_storage_written_pages"] == state["storage_pages_written"]
    sched.close()


def test_no_tier_counters_without_the_tiers():
    sched = make_scheduler()
    assert "host_pool_size" not in sched.get_internal_state()
    sched.close()


def test_cpu_without_storage_or_host_flag_says_why():
    with pytest.raises(ValueError, match="already is host memory.*--hicache-storage-backend file"):
        ServerArgs(device="cpu", enable_hierarchical_cache=True, hicache_ratio=3)
    with pytest.raises(ValueError, match="needs --enable-hierarchical-cache"):
        ServerArgs(device="cpu", hicache_host_tier_on_cpu=True)
    ServerArgs(device="cpu", **HOST, hicache_size=1)  # the host tier sized in GB, on a CPU too


def test_a_cpu_run_never_imports_the_cuda_part():
    code = textwrap.dedent(
        """
        import sys
        from sched_utils import gen_req, make_scheduler, run_to_completion
        sched = make_scheduler(device="cpu", enable_hierarchical_cache=True, hicache_host_tier_on_cpu=True)
        run_to_completion(sched, [gen_req("a", [5, 6, 7, 8], 2)])
        assert sched.tree_cache.host_pool is not None
        print("radixengine.mem_cache.hicache_cuda" in sys.modules)
        """
    )
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join((str(Path(__file__).parent), env["PYTHONPATH"]))
    env["RADIXENGINE_TEST_DEVICE"] = "cpu"  # a CPU run, also where the suite runs on a GPU
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_host_loads_in_flight_is_back_at_zero_when_idle():
    sched = make_scheduler(max_total_tokens=512, **HOST, hicache_ratio=4)
    evict_and_come_back(sched)
    state = sched.get_internal_state()
    assert state["host_tokens_loaded"] >= 128
    assert state["host_loads_in_flight"] == 0
    sched.close()
