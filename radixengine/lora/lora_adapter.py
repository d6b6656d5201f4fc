"""An adapter's weights in the fused layout of our linears, checked against the base model."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass

import torch

from radixengine.lora.lora_config import (
    FUSED_MODULES,
    FUSED_PEFT_MODULES,
    TARGET_MODULES,
    LoRAConfig,
    LoRALoadError,
    split_modules,
)

_KEY = re.compile(r".*\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


@dataclass(frozen=True)
class ModuleShape:
    """A fused linear of the base model as the checkpoint has it: its input features and the
    output rows of each of its stacked parts (q, k, v for qkv_proj; gate, up for gate_up_proj).
    Under tensor parallelism, this rank's slice of it: `in_range` `(start, size)` of the input
    columns (a row-parallel linear's), `out_ranges` `(start, size)` of each part's output rows (a
    column-parallel one's); None: all of them."""

    in_features: int
    out_sizes: tuple[int, ...]
    in_range: tuple[int, int] | None = None
    out_ranges: tuple[tuple[int, int], ...] | None = None

    @property
    def out_features(self) -> int:
        return sum(self.out_sizes)

    @property
    def rank_in_features(self) -> int:
        return self.in_features if self.in_range is None else self.in_range[1]

    @property
    def rank_out_sizes(self) -> tuple[int, ...]:
        return self.out_sizes if self.out_ranges is None else tuple(size for _, size in self.out_ranges)

    def rank_slice(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a fused `a` `[r, stack, in]` and `b` `[r, stack, out]`: A's input
        columns, and of B each part's output rows (one after the other, as the linear's)."""
        if self.in_range is not None:
            start, size = self.in_range
            a = a[..., start : start + size].contiguous()
        if self.out_ranges is not None:
            firsts = [sum(self.out_sizes[:part]) for part in range(len(self.out_sizes))]
            b = torch.cat(
                [b[..., f + start : f + start + size] for f, (start, size) in zip(firsts, self.out_ranges)],
                -1,
            )
        return a, b


# (layer id, fused module name) → its shape
BaseShapes = dict[tuple[int, str], ModuleShape]


@dataclass
class LoRAAdapter:
    """Per (layer, fused module): `a` [r, stack, in] and `b` [r, stack, out] (B already scaled,
    each part's B in its own output rows; under tensor parallelism this rank's slice); modules
    the adapter does not target are absent. `digest`: `weights_digest` of the whole weights."""

    config: LoRAConfig
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: bytes

    @property
    def rank(self) -> int:
        return self.config.r

    @classmethod
    def load(cls, config: LoRAConfig, shapes: BaseShapes, dtype: torch.dtype) -> LoRAAdapter:
        tensors = read_adapter_tensors(config.path)
        return cls.from_tensors(config, tensors, shapes, dtype)

    @classmethod
    def from_tensors(
        cls, config: LoRAConfig, tensors: dict[str, torch.Tensor], shapes: BaseShapes, dtype: torch.dtype
    ) -> LoRAAdapter:
        r = config.r
        weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        filled: dict[tuple[int, str, int], str] = {}  # (layer, fused, part) -> the PEFT module
        pairs = _pairs(config, tensors)
        for (layer, module), (lora_a, lora_b) in sorted(pairs.items()):
            fused = TARGET_MODULES[split_modules(module)[0]][0]
            parts = [TARGET_MODULES[m][1] for m in split_modules(module)]
            shape = shapes.get((layer, fused))
            if shape is None:
                raise LoRALoadError(
                    f"adapter {config.path}: layer {layer} {module} has no linear in the base model"
                )
            outs = [shape.out_sizes[p] for p in parts]
            _check_shape(config, layer, module, "lora_A", lora_a, (r, shape.in_features))
            _check_shape(config, layer, module, "lora_B", lora_b, (sum(outs), r))
            if (layer, fused) not in weights:
                stack = FUSED_MODULES[fused]
                weights[(layer, fused)] = (
                    torch.zeros(r, stack, shape.in_features, dtype=dtype),
                    torch.zeros(r, stack, shape.out_features, dtype=dtype),
                )
            a, b = weights[(layer, fused)]
            scaled_b = (lora_b.float() * config.scaling).t().to(dtype)  # [r, sum(outs)]
            row = 0
            for part, out in zip(parts, outs):
                _claim(filled, config, layer, fused, part, module)
                start = sum(shape.out_sizes[:part])
                a[:, part] = lora_a.to(dtype)  # a fused module: one A for each part it holds
                b[:, part, start : start + out] = scaled_b[:, row : row + out]
                row += out
        digest = weights_digest(weights)
        sliced = {key: shapes[key].rank_slice(a, b) for key, (a, b) in weights.items()}
        return cls(config, sliced, digest)


def weights_digest(weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> bytes:
    """A hash of what the adapter's KV depends on besides the base model: its whole weights as the
    delta uses them (fused, B scaled, in the model's dtype), the same on every TP rank. Equal
    digests, equal KV: the hierarchical cache keys the adapter's storage pages by it
    (docs/lora.md)."""
    h = hashlib.blake2b(digest_size=16)
    for (layer, module), pair in sorted(weights.items()):
        for t in pair:
            h.update(f"{layer}|{module}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def read_adapter_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        return load_file(st)
    bin_file = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(bin_file):
        return torch.load(bin_file, map_location="cpu", weights_only=True)
    raise LoRALoadError(f"adapter {path} has no adapter_model.safetensors or adapter_model.bin")


def _pairs(config: LoRAConfig, tensors: dict[str, torch.Tensor]) -> dict[tuple[int, str], list[torch.Tensor]]:
    pairs: dict[tuple[int, str], list] = {}
    for key, tensor in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None or (m[2] not in TARGET_MODULES and m[2] not in FUSED_PEFT_MODULES):
            raise LoRALoadError(
                f"adapter {config.path}: tensor {key} is not supported (only q/k/v/o/gate/up/down LoRA A/B, "
                "or the fused qkv/gate_up)"
            )
        if m[2] not in config.target_modules:
            raise LoRALoadError(f"adapter {config.path}: tensor {key} is for a module not in target_modules")
        pair = pairs.setdefault((int(m[1]), m[2]), [None, None])
        pair[0 if m[3] == "A" else 1] = tensor
    for (layer, module), (a, b) in pairs.items():
        if a is None or b is None:
            raise LoRALoadError(
                f"adapter {config.path}: layer {layer} {module} has lora_{'A' if a is None else 'B'} missing"
            )
    return pairs


def _claim(filled: dict, config: LoRAConfig, layer: int, fused: str, part: int, module: str) -> None:
    """A part of a fused linear takes one PEFT module's weights (q_proj, or qkv_proj: not both)."""
    other = filled.setdefault((layer, fused, part), module)
    if other != module:
        raise LoRALoadError(f"adapter {config.path}: layer {layer} has both {other} and {module}")


def _check_shape(config: LoRAConfig, layer: int, module: str, which: str, t: torch.Tensor, want) -> None:
    if tuple(t.shape) != tuple(want):
        raise LoRALoadError(
            f"adapter {config.path}: layer {layer} {module}.{which} has shape {tuple(t.shape)}, the base "
            f"model needs {tuple(want)} (an adapter for another base model?)"
        )
