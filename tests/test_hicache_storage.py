"""The hierarchical cache's storage tier (mem_cache/hiradix_cache.py, mem_cache/storage/): KV
read back from files after eviction and after a restart gives transformers' greedy tokens, and
every bad file, folder or writer is survived without using bad bytes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from sched_utils import (
    assert_matches_oracle,
    collect,
    gen_req,
    make_scheduler,
    random_prompts,
    run_to_completion,
)
from test_engine_utils import subprocess_env

from radixengine.managers.io_struct import AbortReq
from radixengine.mem_cache.hiradix_cache import STORAGE_PAGE_TOKENS as PT
from radixengine.mem_cache.storage import file_backend
from radixengine.mem_cache.storage.base import KVIdentity, page_keys
from radixengine.mem_cache.storage.file_backend import TMP_SUFFIX, HiCacheFile

STORAGE_LOGGER = "radixengine.mem_cache.storage.file_backend"
SHARED = random_prompts(11, 1, 150, 150)
PROMPTS = random_prompts(12, 3, 5, 20, shared=SHARED)
OTHER_SHARED = random_prompts(13, 1, 300, 300)
OTHER = random_prompts(14, 3, 5, 20, shared=OTHER_SHARED)


def hicache_scheduler(folder: Path, **overrides):
    args = dict(
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(folder),
        hicache_storage_prefetch_policy="wait_complete",
        page_size=16,
        max_total_tokens=1024,
    )
    args.update(overrides)
    return make_scheduler(**args)


def run(sched, prompts, tag: str, max_new_tokens: int = 8):
    reqs = [gen_req(f"{tag}{i}", p, max_new_tokens) for i, p in enumerate(prompts)]
    return reqs, run_to_completion(sched, reqs)


def whole_pages(prompt: list[int]) -> int:
    """Tokens of the prompt's matchable part (all but its last token) in whole storage pages."""
    return (len(prompt) - 1) // PT * PT


def files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*/*.kv"))


def close(sched) -> None:
    sched.tree_cache.flush_storage()
    sched.close()


# ---- greedy tokens with KV from storage ----------------------------------------------------------

MATRIX = [
    pytest.param(
        page, kv, overlap, policy, id=f"page{page}-{kv}-{'overlap' if overlap else 'normal'}-{policy}"
    )
    for page in (1, 16)
    for kv in ("auto", "bfloat16")
    for overlap in (False, True)
    for policy in ("lru", "slru")
]


def _baseline(page: int, kv: str, overlap: bool, policy: str, prompts, tag: str):
    """The same requests without the storage tier (float32 KV: checked against transformers)."""
    sched = make_scheduler(page_size=page, kv_cache_dtype=kv, overlap=overlap, radix_eviction_policy=policy)
    reqs, results = run(sched, prompts, tag)
    sched.close()
    if kv == "auto":
        assert_matches_oracle(reqs, results)
    return {r.rid[len(tag) :]: results[r.rid].output_ids for r in reqs}


def _assert_same(expected: dict, results: dict, tag: str) -> None:
    for i, ids in expected.items():
        assert results[tag + i].output_ids == ids, f"{tag}{i}: tokens differ from the run without storage"


@pytest.mark.parametrize("page,kv,overlap,policy", MATRIX)
def test_restart_reads_prefix_from_storage(tmp_path, page, kv, overlap, policy):
    expected = _baseline(page, kv, overlap, policy, PROMPTS, "base")
    opts = dict(page_size=page, kv_cache_dtype=kv, overlap=overlap, radix_eviction_policy=policy)
    first = hicache_scheduler(tmp_path, **opts)
    _, cold = run(first, PROMPTS, "cold")
    _assert_same(expected, cold, "cold")
    assert first.tree_cache.storage_hit_tokens == 0
    close(first)
    assert files(tmp_path)

    # A new cache over a cleared pool: what a restarted server has.
    second = hicache_scheduler(tmp_path, **opts)
    _, warm = run(second, PROMPTS, "warm")
    _assert_same(expected, warm, "warm")
    # Every prompt was written whole (with its output) by the first run: each request's
    # prefix is cached, from storage or from pages another request just read.
    for i, prompt in enumerate(PROMPTS):
        assert warm[f"warm{i}"].cached_tokens >= whole_pages(prompt)  # page 1: the tree may add some
    # Each request loads its own pages: the shared prefix once, the rest by whichever comes first.
    assert second.tree_cache.storage_hit_tokens >= len(SHARED[0]) // PT * PT
    close(second)


@pytest.mark.parametrize("page,kv,overlap,policy", MATRIX)
def test_evicted_prefix_comes_back_from_storage(tmp_path, page, kv, overlap, policy):
    expected = _baseline(page, kv, overlap, policy, PROMPTS, "base")
    opts = dict(page_size=page, kv_cache_dtype=kv, overlap=overlap, radix_eviction_policy=policy)
    sched = hicache_scheduler(tmp_path, max_total_tokens=512, **opts)
    run(sched, PROMPTS, "a")
    run(sched, OTHER, "b")  # 300-token prefix: the pool of 512 evicts most of the first prefix
    # How much the pressure evicted depends on how the requests were batched, which waits on the
    # storage threads' prefetches (wait_complete): evict what it left, so that every prompt is
    # read back from storage whatever the timing.
    sched.tree_cache.evict(sched.tree_cache.evictable_size())
    sched.tree_cache.flush_storage()
    assert sched.tree_cache.match_prefix(PROMPTS[0][:-1]).device_indices.numel() == 0
    _, again = run(sched, PROMPTS, "c")
    _assert_same(expected, again, "c")
    assert sched.tree_cache.storage_hit_tokens >= 128
    assert again["c0"].cached_tokens == whole_pages(PROMPTS[0])
    close(sched)


def test_cached_tokens_details_reach_the_output(tmp_path):
    first = hicache_scheduler(tmp_path)
    run(first, PROMPTS[:1], "a")
    close(first)
    second = hicache_scheduler(tmp_path)
    second.io.put(gen_req("b", PROMPTS[0], 4))
    second.run_until_idle(1000)
    outs = [m for m in second.io.take_outputs() if hasattr(m, "cached_tokens_storage")]
    assert outs[-1].cached_tokens_storage == [whole_pages(PROMPTS[0])]
    assert outs[-1].cached_tokens == [whole_pages(PROMPTS[0])]
    close(second)


# ---- write policies --------------------------------------------------------------------------


def test_write_back_writes_on_eviction_only(tmp_path):
    sched = hicache_scheduler(tmp_path, hicache_write_policy="write_back", max_total_tokens=512)
    run(sched, PROMPTS, "a")
    sched.tree_cache.flush_storage()
    assert files(tmp_path) == []
    run(sched, OTHER, "b")  # evicts the first prefix: its pages are written then
    sched.tree_cache.flush_storage()
    assert len(files(tmp_path)) >= 2
    _, again = run(sched, PROMPTS, "c")
    assert sched.tree_cache.storage_hit_tokens >= 128
    close(sched)


def test_write_through_selective_needs_two_hits(tmp_path):
    sched = hicache_scheduler(tmp_path, hicache_write_policy="write_through_selective")
    run(sched, PROMPTS[:1], "a")
    sched.tree_cache.flush_storage()
    assert files(tmp_path) == []
    run(sched, PROMPTS[1:2], "b")  # a second request through the shared prefix: its pages only
    sched.tree_cache.flush_storage()
    assert len(files(tmp_path)) == len(SHARED[0]) // PT
    close(sched)


def test_best_effort_admits_without_waiting_and_uses_a_finished_prefetch(tmp_path):
    first = hicache_scheduler(tmp_path)
    run(first, PROMPTS[:1], "a")
    close(first)
    second = hicache_scheduler(tmp_path, hicache_storage_prefetch_policy="best_effort")
    tree = second.tree_cache
    req = gen_req("b0", PROMPTS[0], 8)
    second.io.put(req)
    second.process_input_requests(second.recv_requests(block=False))  # intake only: no step yet
    # The prefetch started when the request was received (SGLang's _prefetch_kvcache at intake).
    ops = list(tree.prefetcher._ops.values())
    assert [op.keys[0] for op in ops] == page_keys(tuple(PROMPTS[0]), PT, 1)
    ops[0].wait(None)
    second.run_until_idle()
    results = collect(second.io.take_outputs())
    assert tree.storage_hit_tokens == whole_pages(PROMPTS[0])
    assert_matches_oracle([req], results)
    close(second)


# ---- safety ------------------------------------------------------------------------------------


def _write_pages(folder: Path) -> list[Path]:
    sched = hicache_scheduler(folder)
    run(sched, PROMPTS, "w")
    close(sched)
    return files(folder)


def _page_file(folder: Path, page: int) -> Path:
    (tag_dir,) = [p for p in folder.iterdir() if p.is_dir()]
    key = page_keys(tuple(SHARED[0]), PT, page + 1)[page]
    return tag_dir / f"{key}.kv"


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garbage(path: Path) -> None:
    path.write_bytes(b"not a page at all")


@pytest.mark.parametrize("damage", [_corrupt, _truncate, _garbage], ids=["checksum", "truncated", "garbage"])
def test_bad_file_is_recomputed_with_a_warning_naming_it(tmp_path, caplog, damage):
    _write_pages(tmp_path)
    bad = _page_file(tmp_path, 1)
    damage(bad)
    sched = hicache_scheduler(tmp_path)
    with caplog.at_level(logging.WARNING, logger=STORAGE_LOGGER):
        reqs, results = run(sched, PROMPTS, "r")
    assert_matches_oracle(reqs, results)
    assert sched.tree_cache.storage_hit_tokens == PT  # page 0 read, page 1 recomputed
    assert any(str(bad) in rec.getMessage() for rec in caplog.records)
    close(sched)
    assert bad.exists()  # recomputed and written again, whole
    assert (
        HiCacheFile(tmp_path, sched.tree_cache.storage.identity).get(bad.stem, tuple(SHARED[0][PT : 2 * PT]))
        is not None
    )


@pytest.mark.parametrize(
    "field,value",
    [("model", "another-model"), ("kv_dtype", "bfloat16"), ("page_tokens", 128), ("layer_num", 3)],
)
def test_foreign_file_is_not_used(tmp_path, caplog, field, value):
    """A page written under another identity (model, KV dtype, page size, layer count) found
    under this one's name is refused, named, and recomputed."""
    _write_pages(tmp_path)
    good = _page_file(tmp_path, 0)
    mine = HiCacheFile(tmp_path, _identity_of(tmp_path))
    foreign_identity = KVIdentity(**{**mine.identity.__dict__, field: value})
    foreign = HiCacheFile(tmp_path / "other", foreign_identity)
    shape = foreign_identity.page_shape()
    foreign.set(
        good.stem, tuple(SHARED[0][:PT]), torch.zeros(shape, dtype=getattr(torch, foreign_identity.kv_dtype))
    )
    os.replace(foreign.path_of(good.stem), good)  # as if another engine wrote it here
    sched = hicache_scheduler(tmp_path)
    with caplog.at_level(logging.WARNING, logger=STORAGE_LOGGER):
        reqs, results = run(sched, PROMPTS, "r")
    assert_matches_oracle(reqs, results)
    assert sched.tree_cache.storage_hit_tokens == 0
    assert any(
        str(good) in rec.getMessage() and "another model" in rec.getMessage() for rec in caplog.records
    )
    close(sched)


def _identity_of(folder: Path) -> KVIdentity:
    sched = hicache_scheduler(folder)
    identity = sched.tree_cache.storage.identity
    sched.close()
    return identity


def test_other_identities_use_their_own_folder(tmp_path):
    _write_pages(tmp_path)
    sched = hicache_scheduler(tmp_path, kv_cache_dtype="bfloat16")
    run(sched, PROMPTS, "r")
    assert sched.tree_cache.storage_hit_tokens == 0
    close(sched)
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2


def test_unwritable_folder_serves_without_storage_with_one_warning(tmp_path, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING, logger=STORAGE_LOGGER):
        sched = hicache_scheduler(blocker)
        reqs, results = run(sched, PROMPTS, "r")
        reqs2, results2 = run(sched, OTHER, "s")
    assert_matches_oracle(reqs + reqs2, {**results, **results2})
    warnings = [r for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(warnings) == 1
    assert sched.tree_cache.writer.written == 0
    close(sched)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to a read-only folder")
def test_read_only_folder_reads_and_does_not_write(tmp_path, caplog):
    _write_pages(tmp_path)
    for d in [tmp_path, *[p for p in tmp_path.iterdir() if p.is_dir()]]:
        d.chmod(0o555)
    try:
        with caplog.at_level(logging.WARNING, logger=STORAGE_LOGGER):
            sched = hicache_scheduler(tmp_path)
            reqs, results = run(sched, PROMPTS + OTHER, "r")
        assert_matches_oracle(reqs, results)
        assert sched.tree_cache.storage_hit_tokens >= whole_pages(PROMPTS[0])
        assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1
        close(sched)
    finally:
        for d in [tmp_path, *[p for p in tmp_path.iterdir() if p.is_dir()]]:
            d.chmod(0o755)


FULL_DISK_CHILD = textwrap.dedent(
    """
    import logging, resource, signal, sys
    sys.path.insert(0, {tests!r})
    from sched_utils import gen_req, make_scheduler, run_to_completion, assert_matches_oracle, tiny_model_dir
    records = []
    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    logging.getLogger({logger!r}).addHandler(Keep())
    tiny_model_dir()
    sched = make_scheduler(enable_hierarchical_cache=True, hicache_storage_backend="file",
                           hicache_storage_dir={folder!r}, page_size=16, max_total_tokens=1024)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))  # a page is larger: the disk is full
    reqs = [gen_req(f"r{{i}}", p, 8) for i, p in enumerate({prompts!r})]
    results = run_to_completion(sched, reqs)
    sched.tree_cache.flush_storage()
    more = [gen_req(f"s{{i}}", p, 8) for i, p in enumerate({other!r})]
    results.update(run_to_completion(sched, more))
    sched.tree_cache.flush_storage()
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert_matches_oracle(reqs + more, results)
    full = [m for m in records if "cannot write" in m]
    assert len(full) == 1, records
    assert sched.tree_cache.writer.written == 0
    print("FULL-DISK-OK", sched.tree_cache.writer.failed)
    """
)


def test_full_disk_serves_without_storage_with_one_warning(tmp_path):
    code = FULL_DISK_CHILD.format(
        tests=str(Path(__file__).parent),
        logger=STORAGE_LOGGER,
        folder=str(tmp_path),
        prompts=PROMPTS,
        other=OTHER,
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=subprocess_env()
    )
    assert "FULL-DISK-OK" in proc.stdout, proc.stdout + proc.stderr
    assert list(tmp_path.glob("*/*" + TMP_SUFFIX)) == []  # the failed writes left nothing behind
    assert files(tmp_path) == []


KILLED_WRITER_CHILD = textwrap.dedent(
    """
    import sys, torch
    from radixengine.mem_cache.storage.base import KVIdentity
    from radixengine.mem_cache.storage.file_backend import HiCacheFile
    identity = KVIdentity("m", "float32", 64, 16, 8, 128)
    backend = HiCacheFile({folder!r}, identity)
    page = torch.randn(identity.page_shape())
    i = 0
    while True:  # 4 MiB pages, written until the parent kills us
        backend.set(f"{{i:032x}}", tuple(range(64)), page)
        i += 1
        print(i, flush=True)
    """
)


def test_killed_writer_leaves_nothing_that_is_read(tmp_path, caplog):
    identity = KVIdentity("m", "float32", 64, 16, 8, 128)
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER_CHILD.format(folder=str(tmp_path))],
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    for _ in range(5):  # killed once it has written pages, most likely in the middle of the next
        proc.stdout.readline()
    proc.kill()
    proc.wait()
    backend_dir = tmp_path / identity.tag()
    # A half-written temporary file of the kind a kill leaves (whatever the kill hit).
    partial = backend_dir / f".{'f' * 32}-{proc.pid}-deadbeef{TMP_SUFFIX}"
    partial.write_bytes(b"RADIXENGINE-KV-1\n" + b"\x00" * 1000)
    with caplog.at_level(logging.WARNING, logger=STORAGE_LOGGER):
        reader = HiCacheFile(tmp_path, identity)
        assert reader.get("f" * 32, tuple(range(64))) is None  # the temporary name is never read
        pages = sorted(backend_dir.glob("*.kv"))
        assert len(pages) >= 5
        for path in pages:
            assert reader.get(path.stem, tuple(range(64))) is not None, path
    assert not [r for r in caplog.records if "ignoring" in r.getMessage()]
    os.utime(partial, (0, 0))  # an old temporary file: its writer is gone
    HiCacheFile(tmp_path, identity)
    assert not partial.exists()


TWO_WRITERS_CHILD = textwrap.dedent(
    """
    import torch
    from radixengine.mem_cache.storage.base import KVIdentity
    from radixengine.mem_cache.storage.file_backend import HiCacheFile
    identity = KVIdentity("m", "float32", 64, 4, 2, 16)
    backend = HiCacheFile({folder!r}, identity)
    for rnd in range(30):
        for k in range(8):
            torch.manual_seed(k)
            assert backend.set(f"{{k:032x}}", tuple(range(k, k + 64)), torch.randn(identity.page_shape()))
            backend.get(f"{{(k + 3) % 8:032x}}", tuple(range((k + 3) % 8, (k + 3) % 8 + 64)))
    print("DONE")
    """
)


def test_two_engines_on_one_folder_do_not_corrupt_it(tmp_path, caplog):
    code = TWO_WRITERS_CHILD.format(folder=str(tmp_path))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=subprocess_env()
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all("DONE" in o for o in outs)
    identity = KVIdentity("m", "float32", 64, 4, 2, 16)
    reader = HiCacheFile(tmp_path, identity)
    with caplog.at_level(logging.WARNING, logger=STORAGE_LOGGER):
        for k in range(8):
            torch.manual_seed(k)
            expected = torch.randn(identity.page_shape())
            assert torch.equal(reader.get(f"{k:032x}", tuple(range(k, k + 64))), expected)
    assert not caplog.records
    assert list((tmp_path / identity.tag()).glob("*" + TMP_SUFFIX)) == []


def test_folder_size_bound_evicts_least_recently_used(tmp_path):
    identity = KVIdentity("m", "float32", 64, 2, 2, 16)
    page = torch.ones(identity.page_shape())
    probe = HiCacheFile(tmp_path / "probe", identity)
    probe.set("0" * 32, tuple(range(64)), page)
    page_bytes = probe.path_of("0" * 32).stat().st_size
    backend = HiCacheFile(tmp_path, identity, max_bytes=4 * page_bytes)
    keys = [f"{i:032x}" for i in range(10)]
    for i, key in enumerate(keys):
        backend.set(key, tuple(range(64)), page)
        os.utime(backend.path_of(key), (i, i))  # a strict age order whatever the clock's resolution
        if i == 2:
            backend.get(keys[0], tuple(range(64)))  # read: recently used again
            os.utime(backend.path_of(keys[0]), (2.5, 2.5))
    kept = {p.stem for p in backend.dir.glob("*.kv")}
    assert sum(p.stat().st_size for p in backend.dir.glob("*.kv")) <= 4 * page_bytes
    assert keys[-1] in kept and keys[1] not in kept


def test_scheduler_respects_the_size_bound(tmp_path):
    sched = hicache_scheduler(tmp_path, hicache_storage_max_bytes=3 * 34_000)
    run(sched, PROMPTS + OTHER, "r")
    close(sched)
    total = sum(p.stat().st_size for p in files(tmp_path))
    assert 0 < total <= 3 * 34_000


def test_writer_drops_pages_past_its_byte_bound_and_never_waits(tmp_path):
    from radixengine.mem_cache.storage.io_threads import StorageWriter

    identity = KVIdentity("m", "float32", 64, 2, 2, 16)
    page = torch.ones(identity.page_shape())
    page_bytes = page.numel() * page.element_size()
    writer = StorageWriter(HiCacheFile(tmp_path, identity), max_pending_bytes=page_bytes - 1)
    assert not writer.submit("a" * 32, tuple(range(64)), page)
    writer.flush()
    assert (writer.dropped, writer.written) == (1, 0)
    roomy = StorageWriter(HiCacheFile(tmp_path, identity), max_pending_bytes=page_bytes)
    assert roomy.submit("b" * 32, tuple(range(64)), page)
    roomy.close()
    assert (roomy.written, roomy.pending_bytes) == (1, 0)


# ---- prefetches belong to their request --------------------------------------------------------

HEAD = SHARED[0][:PT]
A_LONG, B_SHORT = (HEAD + tail for tail in random_prompts(15, 2, 64, 64))


def _two_prompts_on_disk(folder: Path) -> None:
    first = hicache_scheduler(folder)
    run(first, [A_LONG, B_SHORT], "w")
    close(first)


@pytest.mark.parametrize("policy", ["lof", "priority"])
def test_prompts_sharing_their_first_page_load_their_own_pages(tmp_path, policy):
    """Two prompts whose first storage page is the same: each is loaded with its own pages 2..n,
    whichever is admitted first."""
    _two_prompts_on_disk(tmp_path)
    opts = dict(schedule_policy="lof") if policy == "lof" else dict(enable_priority_scheduling=True)
    sched = hicache_scheduler(tmp_path, **opts)
    # a is queued first; lof (more new tokens) or priority admits b first.
    reqs = [gen_req("a", A_LONG, 2, priority=0), gen_req("b", B_SHORT, 8, priority=5)]
    results = run_to_completion(sched, reqs)
    assert_matches_oracle(reqs, results)
    assert results["a"].cached_tokens == whole_pages(A_LONG)
    assert results["b"].cached_tokens == whole_pages(B_SHORT)
    close(sched)


def test_aborted_longer_prompt_leaves_nothing_for_a_shorter_one(tmp_path):
    """A longer prompt is aborted while queued: its prefetch is revoked, and a shorter prompt
    sharing its first page loads only its own pages."""
    _two_prompts_on_disk(tmp_path)
    sched = hicache_scheduler(tmp_path)
    long = HEAD + A_LONG[PT:] + random_prompts(16, 1, 64, 64)[0]
    sched.io.put(gen_req("long", long, 4))
    sched.process_input_requests(sched.recv_requests(block=False))
    sched.process_input_requests([AbortReq(rid="long")])
    reqs = [gen_req("b", B_SHORT, 8)]
    results = run_to_completion(sched, reqs)
    assert_matches_oracle(reqs, results)
    assert results["b"].cached_tokens == whole_pages(B_SHORT)
    assert sched.tree_cache.tier_stats()["storage_prefetch_bytes"] == 0
    close(sched)


# ---- waiting for prefetches ------------------------------------------------------------------


def _step_until(sched, done, max_steps: int = 5000) -> None:
    for _ in range(max_steps):
        sched.process_input_requests(sched.recv_requests(block=False))
        sched.run_step()
        if done():
            return
    raise AssertionError("condition not reached")


def _in_thread(fn, timeout_s: float = 120.0) -> None:
    """Run `fn` in a thread; fail (not hang) if it does not return in time."""
    errors: list[BaseException] = []

    def target():
        try:
            fn()
        except BaseException as e:  # re-raised below
            errors.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), "the scheduler thread is blocked"
    if errors:
        raise errors[0]


def _release_fifo(path: Path) -> None:
    """Give a reader blocked on the FIFO an end of file."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def test_a_read_that_never_returns_blocks_neither_the_scheduler_nor_later_prefetches(tmp_path):
    first = hicache_scheduler(tmp_path)
    run(first, PROMPTS[:1] + OTHER[:1], "w")
    close(first)
    hung = _page_file(tmp_path, 1)
    hung.unlink()
    os.mkfifo(hung)  # a read of it never returns (as on a hung mount)
    sched = hicache_scheduler(tmp_path)
    tree = sched.tree_cache
    tree.prefetch_timeout_s = 3600.0
    fresh = random_prompts(17, 1, 40, 40)
    reqs = [gen_req("x", PROMPTS[0], 4), gen_req("r", fresh[0], 6)]
    outputs: list = []
    try:

        def first_part():
            sched.io.put(*reqs)
            # r runs to its end while x stays queued, waiting for its prefetch.
            _step_until(sched, lambda: _finished(sched, outputs, "r"))
            assert [q.rid for q in sched.waiting_queue] == ["x"]
            tree.prefetch_timeout_s = 0.0  # now x gives up waiting: its rest is recomputed
            _step_until(sched, lambda: _finished(sched, outputs, "x"))

        _in_thread(first_part)
        results = collect(outputs)
        assert_matches_oracle(reqs, results)
        assert results["x"].cached_tokens == PT  # page 0 from storage, page 1 on no mount
        assert tree.tier_stats()["storage_prefetches_given_up"] == 1
        # A later prefetch (on other pages) is read and loaded.
        later = [gen_req("y", OTHER[0], 4)]
        _in_thread(lambda: results.update(run_to_completion(sched, later)))
        assert_matches_oracle(later, results)
        assert results["y"].cached_tokens == whole_pages(OTHER[0])
    finally:
        _release_fifo(hung)
    close(sched)


def _finished(sched, outputs: list, rid: str) -> bool:
    outputs.extend(sched.io.take_outputs())
    result = collect(outputs).get(rid)
    return result is not None and result.finished_reason is not None


# ---- prefetch memory ---------------------------------------------------------------------------


def test_prefetch_pages_are_freed_when_their_request_leaves(tmp_path):
    _write_pages(tmp_path)
    sched = hicache_scheduler(tmp_path)
    tree = sched.tree_cache
    sched.io.put(gen_req("gone", PROMPTS[1], 4))
    sched.process_input_requests(sched.recv_requests(block=False))  # queued: its prefetch runs
    tree.prefetcher.get("gone").wait(None)
    assert tree.tier_stats()["storage_prefetch_bytes"] > 0
    sched.process_input_requests([AbortReq(rid="gone")])
    assert tree.tier_stats()["storage_prefetch_bytes"] == 0
    reqs, results = run(sched, PROMPTS, "r")
    assert_matches_oracle(reqs, results)
    stats = tree.tier_stats()
    assert stats["storage_prefetches"] == 4 and stats["storage_prefetches_in_flight"] == 0
    assert stats["storage_prefetch_bytes"] == stats["storage_prefetch_reserved_bytes"] == 0
    close(sched)


def test_prefetch_memory_is_bounded_in_bytes(tmp_path):
    _write_pages(tmp_path)
    sched = hicache_scheduler(tmp_path, schedule_policy="fcfs")
    tree = sched.tree_cache
    page_bytes = tree.prefetcher.page_bytes
    tree.prefetcher.max_bytes = 3 * page_bytes
    reqs = [gen_req(f"r{i}", p, 4) for i, p in enumerate(PROMPTS)]
    sched.io.put(reqs[0])
    sched.process_input_requests(sched.recv_requests(block=False))
    # The first request's 10 pages do not fit: it reads 3; the others find no room.
    assert tree.prefetcher.reserved_bytes == 3 * page_bytes
    sched.io.put(*reqs[1:])
    sched.process_input_requests(sched.recv_requests(block=False))
    assert tree.prefetcher.reserved_bytes == 3 * page_bytes
    assert tree.tier_stats()["storage_prefetches_truncated"] == 3
    tree.prefetcher.get("r0").wait(None)
    sched.run_until_idle()
    results = collect(sched.io.take_outputs())
    assert_matches_oracle(reqs, results)
    assert tree.storage_hit_tokens == 3 * PT
    assert tree.prefetcher.reserved_bytes == 0
    close(sched)


# ---- files whose header lies -------------------------------------------------------------------


def rewrite_page(path: Path, edit_header, edit_payload=lambda p: p) -> None:
    """Rewrite a page file with an edited header and payload, its checksum and length updated
    (a file another writer made: every check of the bytes passes)."""
    import json
    import struct
    import zlib

    from radixengine.mem_cache.storage.file_backend import MAGIC

    data = path.read_bytes()
    at = len(MAGIC)
    (n,) = struct.unpack_from("<I", data, at)
    header = json.loads(data[at + 4 : at + 4 + n])
    payload = edit_payload(data[at + 4 + n :])
    header = edit_header({**header, "payload_bytes": len(payload), "crc32": zlib.crc32(payload)})
    raw = json.dumps(header).encode()
    path.write_bytes(MAGIC + struct.pack("<I", len(raw)) + raw + payload)


def as_bfloat16(payload: bytes) -> bytes:
    page = torch.frombuffer(bytearray(payload), dtype=torch.float32)
    return page.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()


def test_page_of_another_dtype_is_recomputed_named_and_deleted(tmp_path, caplog):
    for path in _write_pages(tmp_path):  # every page: the copy into the pool would raise
        rewrite_page(path, lambda h: {**h, "dtype": "bfloat16"}, as_bfloat16)
    bad = [_page_file(tmp_path, 0)]
    sched = hicache_scheduler(tmp_path)
    with caplog.at_level(logging.WARNING, logger=STORAGE_LOGGER):
        reqs, results = run(sched, PROMPTS[:1], "r")
    assert_matches_oracle(reqs, results)
    assert sched.tree_cache.storage_hit_tokens == 0
    named = [r.getMessage() for r in caplog.records if str(bad[0]) in r.getMessage()]
    assert len(named) == 1 and "dtype" in named[0]
    sched.tree_cache.flush_storage()
    # Deleted, then written again whole by the request that recomputed it.
    assert (
        HiCacheFile(tmp_path, sched.tree_cache.storage.identity).get(bad[0].stem, tuple(SHARED[0][:PT]))
        is not None
    )
    close(sched)


@pytest.mark.parametrize("header", [[1, 2], "text", 7, None], ids=["list", "str", "int", "null"])
def test_header_that_is_not_an_object_is_a_bad_file(tmp_path, caplog, header):
    _write_pages(tmp_path)
    bad = _page_file(tmp_path, 0)
    rewrite_page(bad, lambda h: header)
    sched = hicache_scheduler(tmp_path)
    with caplog.at_level(logging.WARNING):
        reqs, results = run(sched, PROMPTS[:1], "r")
    assert_matches_oracle(reqs, results)
    assert sched.tree_cache.storage_hit_tokens == 0
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if str(bad) in m]) == 1, messages
    assert not [r for r in caplog.records if r.exc_info], "a traceback instead of the bad-file path"
    close(sched)


# ---- failed writes, recency, pages already there -----------------------------------------------


def test_a_failed_write_skips_its_page_and_is_retried_later(tmp_path, caplog):
    identity = _identity_of(tmp_path)
    keys = page_keys(tuple(SHARED[0]), PT, 9)
    blocked = tmp_path / identity.tag() / f"{keys[1]}.kv"
    blocked.mkdir(parents=True)  # a folder where page 1's file goes: its write fails
    sched = hicache_scheduler(tmp_path)
    with caplog.at_level(logging.WARNING, logger=STORAGE_LOGGER):
        run(sched, PROMPTS[:1], "a")
        sched.tree_cache.flush_storage()
    assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1
    on_disk = {p.stem for p in files(tmp_path)}
    assert keys[0] in on_disk and keys[2] in on_disk and keys[8] in on_disk  # the others went on
    blocked.rmdir()
    run(sched, PROMPTS[1:2], "b")  # through the same prefix: the skipped page is written now
    sched.tree_cache.flush_storage()
    assert HiCacheFile(tmp_path, identity).get(keys[1], tuple(SHARED[0][PT : 2 * PT])) is not None
    close(sched)


def _page_file_bytes(tmp_path: Path) -> int:
    identity = _identity_of(tmp_path / "probe")
    probe = HiCacheFile(tmp_path / "probe", identity)
    probe.set("0" * 32, tuple(range(PT)), torch.zeros(identity.page_shape()))
    return probe.path_of("0" * 32).stat().st_size


HOT = random_prompts(18, 1, 2 * PT + 2, 2 * PT + 2)[0]  # 2 pages (with its 4 output tokens)
COLD = random_prompts(19, 5, 2 * PT + 2, 2 * PT + 2)


def test_size_bound_keeps_a_prefix_served_from_the_device(tmp_path):
    """The size bound deletes the least recently used pages: a prefix every request hits in
    the device tree is used, though storage never reads it."""
    bound = 7 * _page_file_bytes(tmp_path)
    sched = hicache_scheduler(tmp_path / "store", hicache_storage_max_bytes=bound)
    hot_keys = page_keys(tuple(HOT), PT, 2)
    run(sched, [HOT], "h", max_new_tokens=4)
    for i, cold in enumerate(COLD):  # 10 pages more than the bound holds
        run(sched, [cold, HOT[:-1] + [HOT[-1] + 1]], f"c{i}-", max_new_tokens=4)
        sched.tree_cache.flush_storage()
    kept = {p.stem for p in files(tmp_path / "store")}
    assert set(hot_keys) <= kept
    assert len(kept) < 12  # the bound deleted cold pages
    close(sched)


def test_a_page_the_size_bound_deleted_is_written_again(tmp_path):
    bound = 3 * _page_file_bytes(tmp_path)
    sched = hicache_scheduler(tmp_path / "store", hicache_storage_max_bytes=bound)
    hot_keys = page_keys(tuple(HOT), PT, 2)
    run(sched, [HOT], "h", max_new_tokens=4)
    sched.tree_cache.flush_storage()
    run(sched, COLD[:2], "c", max_new_tokens=4)  # 4 newer pages: the hot ones are deleted
    sched.tree_cache.flush_storage()
    assert not set(hot_keys) & {p.stem for p in files(tmp_path / "store")}
    run(sched, [HOT], "again", max_new_tokens=4)  # from the device tree; written again at its end
    sched.tree_cache.flush_storage()
    assert set(hot_keys) <= {p.stem for p in files(tmp_path / "store")}
    close(sched)


def test_pages_already_on_disk_are_not_written_again_after_a_restart(tmp_path):
    _write_pages(tmp_path)
    before = {p: p.stat().st_ino for p in files(tmp_path)}
    sched = hicache_scheduler(tmp_path)
    run(sched, PROMPTS, "r")
    sched.tree_cache.flush_storage()
    stats = sched.tree_cache.tier_stats()
    assert stats["storage_pages_written"] == 0
    assert stats["storage_pages_present"] > 0
    assert {p: p.stat().st_ino for p in files(tmp_path)} == before
    close(sched)


# ---- the folder's default bound ----------------------------------------------------------------


def test_the_folder_is_bounded_by_default_and_an_unbounded_one_is_named(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE", raising=False)
    with caplog.at_level(logging.WARNING, logger="radixengine.managers.hicache_factory"):
        bounded = hicache_scheduler(tmp_path)
    assert bounded.tree_cache.storage.max_bytes == 8 << 30
    assert "no size bound" not in caplog.text
    bounded.close()
    with caplog.at_level(logging.WARNING, logger="radixengine.managers.hicache_factory"):
        unbounded = hicache_scheduler(tmp_path, hicache_storage_max_bytes=0)
    assert unbounded.tree_cache.storage.max_bytes == 0
    assert f"{tmp_path} has no size bound" in caplog.text
    unbounded.close()


def test_size_bound_is_the_whole_folders(tmp_path, monkeypatch):
    """Two models' engines on one folder: the bound counts both subfolders, and the least recently
    used pages go whichever model wrote them."""
    monkeypatch.setattr(file_backend, "RESCAN_S", 0.0)  # count the folder at every write
    first = KVIdentity("m1", "float32", 64, 2, 2, 16)
    second = KVIdentity("m2", "float32", 64, 2, 2, 16)
    page = torch.ones(first.page_shape())
    probe = HiCacheFile(tmp_path / "probe", first)
    probe.set("0" * 32, tuple(range(64)), page)
    page_bytes = probe.path_of("0" * 32).stat().st_size
    store = tmp_path / "store"
    a = HiCacheFile(store, first, max_bytes=4 * page_bytes)
    b = HiCacheFile(store, second, max_bytes=4 * page_bytes)
    for i in range(3):
        a.set(f"{i:032x}", tuple(range(64)), page)
        os.utime(a.path_of(f"{i:032x}"), (i, i))
    for i in range(3):
        b.set(f"{i:032x}", tuple(range(64)), page)
    on_disk = list(store.glob("*/*.kv"))
    assert sum(p.stat().st_size for p in on_disk) <= 4 * page_bytes
    assert not a.path_of(f"{0:032x}").exists()  # the oldest page, of the other model
    assert {p.stem for p in (store / second.tag()).glob("*.kv")} == {f"{i:032x}" for i in range(3)}
