"""The model worker's LoRA manager, made from the server's LoRA flags (docs/lora.md)."""

from __future__ import annotations

import torch
from torch import nn

from radixengine.lora.lora_config import LoRAConfig
from radixengine.lora.lora_manager import DEFAULT_MAX_LORA_RANK, LoRAManager, resolve_lora_path
from radixengine.lora.lora_registry import parse_lora_paths
from radixengine.server_args_lora import LoRAArgs


def make_lora_manager(
    args: LoRAArgs, model: nn.Module, dtype: torch.dtype, device: torch.device
) -> LoRAManager | None:
    """The manager with `--lora-paths` loaded (None without --enable-lora)."""
    if not args.enable_lora:
        return None
    refs = parse_lora_paths(args.lora_paths)
    configs = [LoRAConfig.from_folder(resolve_lora_path(r.lora_path)) for r in refs]
    max_rank = args.max_lora_rank or max((c.r for c in configs), default=DEFAULT_MAX_LORA_RANK)
    modules = args.lora_target_modules or ["all"]
    manager = LoRAManager(
        model,
        args.max_loras_per_batch,
        max_rank,
        args.lora_eviction_policy,
        args.max_loaded_loras,
        None if "all" in modules else modules,
        dtype,
        device,
    )
    for ref in refs:
        manager.load_adapter(ref.lora_id, ref.lora_path, ref.pinned)
    return manager
