"""Reading checkpoint tensors: safetensors folders, dtype choice."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

SAFE_INDEX = "model.safetensors.index.json"


def safetensors_files(folder: str | Path) -> list[Path]:
    """The checkpoint's *.safetensors files (those of the index when the checkpoint is sharded)."""
    folder = Path(folder)
    index = folder / SAFE_INDEX
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return files


def safetensors_weights_iterator(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def cpu_has_native_bf16() -> bool:
    """True when torch's CPU kernels run bf16 matmuls natively (AMX or AVX512-BF16)."""
    capability = str(torch.backends.cpu.get_cpu_capability()).upper()
    return "AMX" in capability or "AVX512_BF16" in capability or _cpuinfo_has_bf16()


def _cpuinfo_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_bf16" in flags or " avx512_bf16" in flags


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """`auto`: bfloat16 on CUDA, and on a CPU that multiplies bf16 natively; else float32."""
    if dtype != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    if device == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
