"""The LoRA flags (SGLang's names): their help and their rules (docs/lora.md)."""

from __future__ import annotations

from typing import Protocol

from radixengine.lora.lora_config import TARGET_MODULES
from radixengine.lora.lora_registry import parse_lora_paths

LORA_EVICTION_POLICIES = ("lru", "fifo")

LORA_HELP = {
    "enable_lora": "Serve LoRA adapters (on by itself when --lora-paths is given); see docs/lora.md.",
    "lora_paths": (
        'Adapters loaded at start, each PATH, NAME=PATH or JSON {"lora_name", "lora_path", "pinned"}: '
        "a PEFT folder (adapter_config.json + adapter_model.safetensors / .bin) or a Hugging Face repo id "
        "in the local cache."
    ),
    "max_loras_per_batch": "Distinct adapters one batch may use (the slots of the adapter pool).",
    "max_loaded_loras": "Adapters kept in host memory at most (loading one more is refused); default no bound.",
    "lora_eviction_policy": "Which adapter leaves a pool slot for another: lru or fifo (pinned ones never).",
    "max_lora_rank": "The pool's rank (adapters of a higher rank are refused); default the largest of --lora-paths, else 64.",
    "lora_target_modules": (
        "The modules adapters may target (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or all); "
        "default all."
    ),
}


class LoRAArgs(Protocol):
    enable_lora: bool
    lora_paths: list[str] | None
    max_loras_per_batch: int
    max_loaded_loras: int | None
    lora_eviction_policy: str
    max_lora_rank: int | None
    lora_target_modules: list[str] | None


def validate_lora_args(args: LoRAArgs) -> None:
    if args.lora_paths:
        args.enable_lora = True
    refs = parse_lora_paths(args.lora_paths)
    for name in ("max_loras_per_batch", "max_loaded_loras", "max_lora_rank"):
        value = getattr(args, name)
        if not (value is None and name != "max_loras_per_batch") and not _positive_int(value):
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
    if args.max_loaded_loras is not None and len(refs) > args.max_loaded_loras:
        raise ValueError(
            f"--lora-paths names {len(refs)} adapters, more than --max-loaded-loras {args.max_loaded_loras}"
        )
    if args.lora_eviction_policy not in LORA_EVICTION_POLICIES:
        raise ValueError(
            f"--lora-eviction-policy must be one of {', '.join(LORA_EVICTION_POLICIES)}; "
            f"got {args.lora_eviction_policy!r}"
        )
    unknown = [m for m in args.lora_target_modules or [] if m not in TARGET_MODULES and m != "all"]
    if unknown:
        raise ValueError(
            f"--lora-target-modules: {unknown} are not supported (supported: {', '.join(TARGET_MODULES)}, all)"
        )


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
