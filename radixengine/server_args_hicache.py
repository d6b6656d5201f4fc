"""The hierarchical cache's flags (SGLang's HiCache names): their help and their rules.

`ServerArgs.validate` calls `validate_hicache`. The host tier (a host pool under the device pool,
sized by `--hicache-ratio` / `--hicache-size`) is on with `--enable-hierarchical-cache` on a GPU.
On a CPU the device pool already is host memory: the host tier would only copy bytes within the
same memory, so it is off there and `--enable-hierarchical-cache` needs the storage tier;
`--hicache-host-tier-on-cpu` turns the host tier on anyway (with a warning), which is how its
logic is tested without a GPU.
"""

from __future__ import annotations

import logging
import os
from typing import Protocol

from radixengine.mem_cache.storage.policies import (
    DEFAULT_FILE_BACKEND_DIR,
    DEFAULT_FILE_BACKEND_MAX_BYTES,
    FILE_BACKEND_DIR_ENV,
    FILE_BACKEND_MAX_SIZE_ENV,
    HICACHE_PREFETCH_POLICIES,
    HICACHE_STORAGE_BACKENDS,
    HICACHE_WRITE_POLICIES,
)

logger = logging.getLogger(__name__)

DEFAULT_HICACHE_RATIO = 2.0  # ServerArgs.hicache_ratio's default (SGLang's)

HICACHE_CHOICES = {
    "hicache_write_policy": HICACHE_WRITE_POLICIES,
    "hicache_storage_backend": HICACHE_STORAGE_BACKENDS,
    "hicache_storage_prefetch_policy": HICACHE_PREFETCH_POLICIES,
}

HICACHE_HELP = {
    "enable_hierarchical_cache": (
        "Back the radix cache with more tiers (SGLang's HiCache): on a GPU a host memory pool that "
        "keeps what the device pool evicts; on every device the storage tier "
        "(--hicache-storage-backend file), whose pages are found again after a restart."
    ),
    "hicache_ratio": (
        "Host tier size as a ratio of the device pool's tokens (the host tier: on a GPU, or on a CPU "
        "with --hicache-host-tier-on-cpu)."
    ),
    "hicache_size": "Host tier size in GB, overrides --hicache-ratio (refused on a CPU without a host tier).",
    "hicache_host_tier_on_cpu": (
        "Run the host tier over a CPU KV pool: host and device memory are the same there, so it only "
        "costs copies; for testing the host tier's logic without a GPU."
    ),
    "hicache_write_policy": (
        "When pages go to storage: write_through (default; every page of a request's prefix when it "
        "finishes), write_through_selective (only pages at least 2 requests used), write_back (when "
        "eviction frees them)."
    ),
    "hicache_storage_backend": "The storage tier's backend: file (one file per page in a folder).",
    "hicache_storage_dir": (
        f"The file backend's folder; default ${FILE_BACKEND_DIR_ENV}, else {DEFAULT_FILE_BACKEND_DIR}."
    ),
    "hicache_storage_max_bytes": (
        f"Size bound of the file backend's folder in bytes, all its subfolders together (least "
        f"recently used pages are deleted past it); 0: no bound (a warning at start). Default "
        f"${FILE_BACKEND_MAX_SIZE_ENV}, else {DEFAULT_FILE_BACKEND_MAX_BYTES >> 30} GiB."
    ),
    "hicache_storage_prefetch_policy": (
        "How long a queued request waits for its pages being read from storage (it stays queued, "
        "other batches run): best_effort (default; admitted with what has arrived), timeout (at most "
        "2 s + 0.25 s per 1024 tokens of the read), wait_complete (all of them, unless no page "
        "arrives for that long)."
    ),
}


class HiCacheArgs(Protocol):
    """What the hierarchical cache's rules read of ServerArgs."""

    device: str
    disable_radix_cache: bool
    enable_hierarchical_cache: bool
    hicache_ratio: float
    hicache_size: int
    hicache_storage_backend: str | None
    hicache_storage_dir: str | None
    hicache_storage_max_bytes: int | None
    hicache_host_tier_on_cpu: bool


def resolve_storage_dir(args: HiCacheArgs) -> str:
    return args.hicache_storage_dir or os.environ.get(FILE_BACKEND_DIR_ENV) or DEFAULT_FILE_BACKEND_DIR


def resolve_storage_max_bytes(args: HiCacheArgs) -> int:
    """The folder's size bound: the flag, else SGLang's variable, else the default; 0: none."""
    if args.hicache_storage_max_bytes is not None:
        return args.hicache_storage_max_bytes
    env = os.environ.get(FILE_BACKEND_MAX_SIZE_ENV)
    return int(env) if env else DEFAULT_FILE_BACKEND_MAX_BYTES


def validate_hicache(args: HiCacheArgs) -> None:
    """Refuse combinations the hierarchical cache cannot serve, naming why."""
    for name, choices in HICACHE_CHOICES.items():
        value = getattr(args, name)
        if value is not None and value not in choices:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be one of {', '.join(choices)}; got {value!r}")
    if args.hicache_ratio <= 0:
        raise ValueError(f"--hicache-ratio must be > 0, got {args.hicache_ratio}")
    if args.hicache_size < 0 or (args.hicache_storage_max_bytes or 0) < 0:
        raise ValueError("--hicache-size and --hicache-storage-max-bytes must be >= 0")
    if not args.enable_hierarchical_cache:
        for name in ("hicache_storage_backend", "hicache_host_tier_on_cpu"):
            if getattr(args, name):
                raise ValueError(f"--{name.replace('_', '-')} needs --enable-hierarchical-cache")
        if args.hicache_size or args.hicache_ratio != DEFAULT_HICACHE_RATIO:
            logger.warning("--hicache-ratio / --hicache-size do nothing without --enable-hierarchical-cache")
        return
    if args.disable_radix_cache:
        raise ValueError("--enable-hierarchical-cache backs the radix cache: not with --disable-radix-cache")
    if args.device == "cpu":
        _validate_cpu(args)


def has_host_tier(args: HiCacheArgs) -> bool:
    return args.enable_hierarchical_cache and (args.device != "cpu" or args.hicache_host_tier_on_cpu)


def _validate_cpu(args: HiCacheArgs) -> None:
    if args.hicache_host_tier_on_cpu:
        logger.warning(
            "--hicache-host-tier-on-cpu: the host tier over a CPU KV pool; host and device memory are "
            "the same memory here, so it only adds copies (it is there to test the host tier)"
        )
        return
    if args.hicache_storage_backend is not None and args.hicache_ratio != DEFAULT_HICACHE_RATIO:
        logger.warning(
            "--hicache-ratio: on a CPU there is no host tier (the KV pool is host memory); ignored"
        )
    if args.hicache_size:
        raise ValueError(
            "--hicache-size: on a CPU the KV pool already is host memory; there is no host tier "
            "(use --max-total-tokens for a larger pool)"
        )
    if args.hicache_storage_backend is None:
        raise ValueError(
            "--enable-hierarchical-cache on a CPU: the KV pool already is host memory, so there is no "
            "host tier (--hicache-ratio / --hicache-size would do nothing); add --hicache-storage-backend "
            "file for the storage tier"
        )
