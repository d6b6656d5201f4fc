"""AWQ and GPTQ checkpoints (config.json's `quantization_config`): their packed integer weights
dequantized to float weights at load, exactly (`scale * (q - zero)` is exact in float32 for these
bit widths; the model's dtype rounds it once). Any other quantization method is refused at start.

Formats, per linear with `K` inputs, `N` outputs, groups of `G` inputs:
- AWQ (AutoAWQ "gemm"): `qweight` int32 [K, N/8] and `qzeros` int32 [K/G, N/8] pack 8 4-bit
  values along N in the order 0 2 4 6 1 3 5 7; `scales` [K/G, N]; w = s * (q - z).
- GPTQ: `qweight` int32 [K*b/32, N] packs along K, `qzeros` int32 [K/G, N*b/32] along N, both
  from bit 0 up; `scales` [K/G, N]; `g_idx` [K] the group of each input (act-order, desc_act,
  permutes it; absent: k // G); w = s[g] * (q - (z[g] + 1)), the +1 undoing GPTQ's stored
  `zero - 1` ("gptq" format; "gptq_v2" stores the zero itself).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED = "awq (version gemm, 4-bit, with zero points) and gptq (2, 4 or 8 bits; format gptq or gptq_v2)"
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # packed position of output column j in a word
_PARTS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx")}
_OPTIONAL = frozenset({"g_idx"})
_PACKED = frozenset({"qweight", "qzeros", "g_idx"})


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "awq" | "gptq"
    bits: int
    group_size: int  # -1: one group for all inputs
    zero_offset: int = 0  # added to the stored zero points (1 for GPTQ's original format)

    @classmethod
    def from_model(cls, hf_config, folder: str | Path) -> QuantConfig | None:
        """The checkpoint's quantization, None when it has none; an unsupported one is refused."""
        raw = _raw_config(hf_config, folder)
        if raw is None:
            return None
        method = str(raw.get("quant_method", "")).lower()
        if method == "awq":
            return cls._awq(raw)
        if method == "gptq":
            return cls._gptq(raw)
        raise ValueError(_refusal(f"quantization method {method!r}"))

    @classmethod
    def _awq(cls, raw: dict) -> QuantConfig:
        bits = int(raw.get("bits", raw.get("w_bit", 4)))
        version = str(raw.get("version", "gemm")).lower()
        backend = str(raw.get("backend") or "autoawq").lower()
        if bits != 4 or version != "gemm" or not raw.get("zero_point", True) or backend != "autoawq":
            detail = (
                f"{bits}-bit, version {version}, zero_point {raw.get('zero_point', True)}, backend {backend}"
            )
            raise ValueError(_refusal(f"quantization method 'awq' ({detail})"))
        return cls("awq", bits, int(raw.get("group_size", raw.get("q_group_size", 128))))

    @classmethod
    def _gptq(cls, raw: dict) -> QuantConfig:
        bits = int(raw.get("bits", 4))
        fmt = str(raw.get("checkpoint_format") or raw.get("format") or "gptq").lower()
        if bits not in (2, 4, 8) or fmt not in ("gptq", "gptq_v2") or raw.get("is_marlin_format"):
            detail = f"{bits}-bit, format {'marlin' if raw.get('is_marlin_format') else fmt}"
            raise ValueError(_refusal(f"quantization method 'gptq' ({detail})"))
        return cls("gptq", bits, int(raw.get("group_size", 128)), zero_offset=1 if fmt == "gptq" else 0)

    @property
    def parts(self) -> tuple[str, ...]:
        return _PARTS[self.method]

    def describe(self) -> str:
        group = "per row" if self.group_size <= 0 else f"groups of {self.group_size}"
        return f"{self.method} {self.bits}-bit, {group}"

    def dequantize(self, prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """The float32 weight [N, K] of one linear from its packed parts."""
        missing = [p for p in self.parts if p not in parts and p not in _OPTIONAL]
        if missing:
            raise ValueError(
                f"checkpoint lacks {', '.join(f'{prefix}.{p}' for p in missing)} ({self.method})"
            )
        if self.method == "awq":
            q, z = _awq_unpack(parts["qweight"]), _awq_unpack(parts["qzeros"])
        else:
            q = _unpack_rows(parts["qweight"], self.bits)
            z = _unpack_cols(parts["qzeros"], self.bits)[:, : q.shape[1]] + self.zero_offset
        groups = parts.get("g_idx")
        k = q.shape[0]
        if groups is None:
            groups = torch.arange(k) // (self.group_size if self.group_size > 0 else k)
        groups = groups.long()
        w = (q - z[groups]).float() * parts["scales"].float()[groups]
        return w.t().contiguous()


def dequantized_weights(
    weights: Iterable[tuple[str, torch.Tensor]], config: QuantConfig, expected: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each linear's packed parts replaced by its float `weight`
    (yielded once all its parts were read; shards may split them). All-zero biases of linears
    that have none in the model (GPTQ writes them) are dropped."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part in config.parts:
            got = pending.setdefault(prefix, {})
            got[part] = tensor
            if len(got) == len(config.parts):
                yield f"{prefix}.weight", config.dequantize(prefix, pending.pop(prefix))
        elif part == "bias" and name not in expected and not tensor.any():
            continue
        else:
            yield name, tensor
    for prefix, got in pending.items():  # the linears without g_idx, or lacking a part
        yield f"{prefix}.weight", config.dequantize(prefix, got)


def unquantized_weights(
    weights: Iterable[tuple[str, torch.Tensor]], expected: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a checkpoint whose config names no quantization; packed parts are refused
    (biases the model lacks come last, so that a packed checkpoint is named for what it is)."""
    extra_biases = []
    for name, tensor in weights:
        if name.rpartition(".")[2] in _PACKED:
            raise ValueError(
                f"checkpoint tensor {name} is part of a packed quantized weight, but the model's config.json "
                f"has no quantization_config naming its method; {SUPPORTED} checkpoints load"
            )
        if name.endswith(".bias") and name not in expected:
            extra_biases.append((name, tensor))
        else:
            yield name, tensor
    yield from extra_biases


def _raw_config(hf_config, folder: str | Path) -> dict | None:
    raw = getattr(hf_config, "quantization_config", None)
    if raw is not None:
        return raw if isinstance(raw, dict) else raw.to_dict()
    for name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):  # older tools
        path = Path(folder, name)
        if path.exists():
            return {"quant_method": method, **json.loads(path.read_text())}
    return None


def _refusal(what: str) -> str:
    return f"{what} (config.json quantization_config) is not supported: only {SUPPORTED} checkpoints load"


def _shifts(bits: int) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32)


def _unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> [R, C * 32/bits]: word c's value j (from bit 0 up) at column c*32/bits + j."""
    values = (packed.unsqueeze(-1) >> _shifts(bits)) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0], -1)


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> [R * 32/bits, C]: word r's value j at row r*32/bits + j."""
    values = (packed.unsqueeze(1) >> _shifts(bits).view(1, -1, 1)) & ((1 << bits) - 1)
    return values.reshape(-1, packed.shape[1])


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 [R, N/8] -> [R, N] in column order."""
    values = _unpack_cols(packed, 4)
    order = torch.arange(values.shape[1]).view(-1, 8)[:, list(AWQ_REVERSE_ORDER)].reshape(-1)
    return values[:, order]
