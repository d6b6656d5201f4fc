"""An adapter's `adapter_config.json` (PEFT's format), checked for what radixengine serves."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

# PEFT's module names → (our fused linear, its stack index)
TARGET_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
# PEFT's names for the modules of checkpoints that fuse them (Phi-3): each stands for the split
# modules it holds, one A for all of them and B's output rows in their order.
FUSED_PEFT_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# Our fused linears and how many PEFT modules each stacks.
FUSED_MODULES: dict[str, int] = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}
# PEFT's shorthands for target_modules.
_ALL_LINEAR = ("all-linear", "all")


class LoRALoadError(ValueError):
    """An adapter that cannot be served: the message names what is not supported."""


@dataclass(frozen=True)
class LoRAConfig:
    path: str
    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]  # PEFT names, of TARGET_MODULES and FUSED_PEFT_MODULES
    use_rslora: bool = False

    @property
    def split_target_modules(self) -> tuple[str, ...]:
        """The modules of TARGET_MODULES the adapter targets (a fused one: the modules it holds)."""
        return tuple(sorted({s for m in self.target_modules for s in split_modules(m)}))

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def from_folder(cls, path: str) -> LoRAConfig:
        config_file = os.path.join(path, "adapter_config.json")
        if not os.path.isfile(config_file):
            raise LoRALoadError(f"{path} has no adapter_config.json (not a PEFT LoRA adapter)")
        with open(config_file) as f:
            raw = json.load(f)
        return cls.from_dict(path, raw)

    @classmethod
    def from_dict(cls, path: str, raw: dict) -> LoRAConfig:
        _check_supported(path, raw)
        r = raw.get("r")
        if not isinstance(r, int) or r <= 0:
            raise LoRALoadError(f"adapter {path}: r must be a positive integer, got {r!r}")
        alpha = raw.get("lora_alpha", r)
        return cls(
            path=path,
            r=r,
            lora_alpha=float(alpha),
            target_modules=_target_modules(path, raw.get("target_modules")),
            use_rslora=bool(raw.get("use_rslora", False)),
        )


def _check_supported(path: str, raw: dict) -> None:
    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRALoadError(f"adapter {path}: peft_type {peft_type!r} is not supported (only LORA)")
    refused = {
        "use_dora": raw.get("use_dora"),
        "modules_to_save": raw.get("modules_to_save"),
        "rank_pattern": raw.get("rank_pattern"),
        "alpha_pattern": raw.get("alpha_pattern"),
        "layers_to_transform": raw.get("layers_to_transform"),
        "fan_in_fan_out": raw.get("fan_in_fan_out"),
        "trainable_token_indices": raw.get("trainable_token_indices"),
        "target_parameters": raw.get("target_parameters"),
    }
    for name, value in refused.items():
        if value:
            raise LoRALoadError(f"adapter {path}: {name}={value!r} is not supported")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise LoRALoadError(f"adapter {path}: bias={bias!r} is not supported (only 'none')")


def split_modules(name: str) -> tuple[str, ...]:
    """The TARGET_MODULES a PEFT module name stands for."""
    return FUSED_PEFT_MODULES.get(name, (name,))


def _target_modules(path: str, target) -> tuple[str, ...]:
    if isinstance(target, str):
        if target in _ALL_LINEAR:
            return (*TARGET_MODULES, *FUSED_PEFT_MODULES)
        raise LoRALoadError(f"adapter {path}: target_modules as a regex ({target!r}) is not supported")
    if not target:
        raise LoRALoadError(f"adapter {path}: no target_modules")
    names = tuple(sorted({str(t).rsplit(".", 1)[-1] for t in target}))
    unknown = [n for n in names if n not in TARGET_MODULES and n not in FUSED_PEFT_MODULES]
    if unknown:
        raise LoRALoadError(
            f"adapter {path}: target modules {unknown} are not supported "
            f"(supported: {', '.join((*TARGET_MODULES, *FUSED_PEFT_MODULES))})"
        )
    return names
