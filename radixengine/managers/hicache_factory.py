"""Builds the scheduler's tree cache: the chunk cache, the radix cache, or with
--enable-hierarchical-cache the radix cache over the host tier (mem_cache/host_radix_cache.py)
and/or the storage tier (mem_cache/hiradix_cache.py)."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from radixengine.distributed import get_tp_group, tensor_model_parallel_all_reduce_min
from radixengine.mem_cache.allocator import BaseTokenToKVPoolAllocator
from radixengine.mem_cache.base_prefix_cache import BasePrefixCache
from radixengine.mem_cache.chunk_cache import ChunkCache
from radixengine.mem_cache.hicache_transfer import HostTransfer, InlineHostTransfer
from radixengine.mem_cache.hiradix_cache import (
    DEFAULT_MAX_PREFETCH_BYTES,
    HiRadixCache,
    PrefetchConfig,
    storage_page_tokens,
)
from radixengine.mem_cache.host_radix_cache import HostRadixCache
from radixengine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from radixengine.mem_cache.memory_pool_host import HostKVPool
from radixengine.mem_cache.radix_cache import RadixCache
from radixengine.mem_cache.storage.base import KVIdentity
from radixengine.mem_cache.storage.file_backend import HiCacheFile
from radixengine.server_args import ServerArgs
from radixengine.server_args_hicache import has_host_tier, resolve_storage_dir, resolve_storage_max_bytes

logger = logging.getLogger(__name__)


def make_tree_cache(
    args: ServerArgs, req_to_token_pool: ReqToTokenPool, allocator: BaseTokenToKVPoolAllocator
) -> BasePrefixCache:
    """The chunk cache (--disable-radix-cache), the radix cache, or the one over the storage tier."""
    if args.disable_radix_cache:
        return ChunkCache(req_to_token_pool, allocator, args.page_size)
    return make_radix_cache(args, req_to_token_pool, allocator, args.page_size)


def make_radix_cache(
    args: ServerArgs, req_to_token_pool: ReqToTokenPool, allocator: BaseTokenToKVPoolAllocator, page_size: int
) -> RadixCache:
    if not args.enable_hierarchical_cache:
        return RadixCache(
            req_to_token_pool,
            allocator,
            page_size,
            eviction_policy=args.radix_eviction_policy,
            evict_leaf_tails=args.soft_priority_preemption,
        )
    pool = allocator.get_kvcache()
    if not hasattr(pool, "k_buffer"):
        raise ValueError(
            f"--enable-hierarchical-cache: the KV pool {type(pool).__name__} has no K/V buffers to store"
        )
    host_pool, transfer = make_host_tier(args, pool, page_size) if has_host_tier(args) else (None, None)
    common = dict(
        eviction_policy=args.radix_eviction_policy,
        evict_leaf_tails=args.soft_priority_preemption,
        write_policy=args.hicache_write_policy,
        host_pool=host_pool,
        host_transfer=transfer,
    )
    if args.hicache_storage_backend is None:
        return HostRadixCache(req_to_token_pool, allocator, page_size, **common)
    storage = make_file_backend(args, pool, page_size)
    return HiRadixCache(
        req_to_token_pool,
        allocator,
        page_size,
        storage,
        prefetch=PrefetchConfig(
            args.hicache_storage_prefetch_policy,
            max_bytes=min(DEFAULT_MAX_PREFETCH_BYTES, pool.size * HostKVPool.bytes_per_token(pool)),
        ),
        ranks_min=tensor_model_parallel_all_reduce_min,
        **common,
    )


def make_file_backend(args: ServerArgs, pool: MHATokenToKVPool, page_size: int) -> HiCacheFile:
    folder, max_bytes = resolve_storage_dir(args), resolve_storage_max_bytes(args)
    if max_bytes == 0:
        logger.warning(
            "hicache storage: %s has no size bound (--hicache-storage-max-bytes 0): it grows by every "
            "new prefix until the disk is full",
            folder,
        )
    storage = HiCacheFile(folder, kv_identity(args, pool, page_size), max_bytes)
    free = storage.free_disk_bytes()
    if max_bytes and free is not None and free + storage.total_bytes() < max_bytes:
        logger.warning(
            "hicache storage: the size bound of %s (%d bytes) is more than its disk has free (%d "
            "bytes); a full disk deletes the least recently used pages",
            folder,
            max_bytes,
            free,
        )
    return storage


def make_host_tier(
    args: ServerArgs, pool: MHATokenToKVPool, page_size: int
) -> tuple[HostKVPool, HostTransfer]:
    """The host pool (--hicache-size GB, else --hicache-ratio times the device pool's tokens) and
    its copies: pinned memory and a copy stream on CUDA (imported only there), inline elsewhere."""
    if args.hicache_size:
        size = int(args.hicache_size * 1e9 // HostKVPool.bytes_per_token(pool))
    else:
        size = int(pool.size * args.hicache_ratio)
    size = max(size // page_size * page_size, page_size)
    device = pool.k_buffer[0].device
    logger.info("hierarchical cache: host tier of %d tokens under a device pool of %d", size, pool.size)
    if device.type == "cuda":
        from radixengine.mem_cache.hicache_cuda import CudaHostTransfer, pinned_host_pool

        return pinned_host_pool(pool, size), CudaHostTransfer(device)
    return HostKVPool.like(pool, size), InlineHostTransfer()


def kv_identity(args: ServerArgs, pool: MHATokenToKVPool, page_size: int) -> KVIdentity:
    model = "|".join(
        (
            _model_fingerprint(args.model_path),
            f"revision={args.revision}",
            f"dtype={args.dtype}",
            f"quantization={args.quantization}",
            f"load_format={args.load_format}",
            f"tp={args.tp_size}",
            # each rank's pages hold its own heads (one rank: the identity as before ranks)
            *([f"tp_rank={get_tp_group().rank}"] if args.tp_size > 1 else []),
        )
    )
    return KVIdentity(
        model=model,
        kv_dtype=str(pool.dtype).removeprefix("torch."),
        page_tokens=storage_page_tokens(page_size),
        layer_num=pool.layer_num,
        head_num=pool.head_num,
        head_dim=pool.head_dim,
    )


def _model_fingerprint(model_path: str | None) -> str:
    """The model's path with the names, sizes and times of its files (a model saved again at the
    same path is another model)."""
    if model_path is None:
        from radixengine.model_loader import default_model_path

        model_path = default_model_path()
    path = Path(model_path)
    if not path.exists():
        return str(model_path)  # a repo id: its revision names it
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.blake2b(digest_size=8)
    for p in files:
        st = p.stat()
        digest.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return f"{os.path.realpath(path)}#{digest.hexdigest()}"
