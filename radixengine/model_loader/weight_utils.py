"""Reading checkpoint tensors: safetensors or PyTorch .bin folders, sharded or not, dtype choice;
writing a float32 safetensors file one tensor at a time."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from radixengine.utils.cpu_bf16 import bf16_matmul_support

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
# .bin files of a training run saved beside the weights (SGLang skips the same)
NOT_WEIGHTS = frozenset({"training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"})


def safetensors_files(folder: str | Path) -> list[Path]:
    """The checkpoint's *.safetensors files (those of the index when the checkpoint is sharded)."""
    files = _indexed_or_glob(Path(folder), SAFE_INDEX, "*.safetensors")
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return files


def checkpoint_files(folder: str | Path) -> list[Path]:
    """The weight files: *.safetensors when there are any, else PyTorch *.bin pickles (those of
    pytorch_model.bin.index.json when it exists)."""
    folder = Path(folder)
    files = _indexed_or_glob(folder, SAFE_INDEX, "*.safetensors") or _indexed_or_glob(
        folder, BIN_INDEX, "*.bin"
    )
    if not files:
        raise FileNotFoundError(f"no weights in {folder}: no *.safetensors nor *.bin files")
    return files


def _indexed_or_glob(folder: Path, index_name: str, pattern: str) -> list[Path]:
    index = folder / index_name
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    return sorted(p for p in folder.glob(pattern) if p.name not in NOT_WEIGHTS)


def weights_iterator(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor of the folder, one file at a time."""
    for path in checkpoint_files(folder):
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            yield from _load_pt(path).items()


def _load_pt(path: Path) -> dict[str, torch.Tensor]:
    """A PyTorch state dict, tensors only (`weights_only`: no code runs from the pickle),
    memory-mapped when the file is in torch's zip format."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)


def write_safetensors(
    path: str | Path, specs: Sequence[tuple[str, tuple[int, ...]]], arrays: Iterable[np.ndarray]
) -> None:
    """A float32 safetensors file, written as `arrays` come: the header from `specs` (name and
    shape of each tensor, in order) first, then each array's bytes, so only the array being
    written need be in memory (`safetensors.save_file` wants every tensor at once)."""
    blob = _safetensors_header(specs)
    arrays = iter(arrays)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape in specs:
            array = next(arrays, None)  # (zip would hold the previous array while making this one)
            if array is None:
                raise ValueError(f"{len(specs)} tensors in the header; no array for {name}")
            if array.dtype != np.float32 or array.shape != tuple(shape):
                raise ValueError(f"{name}: got {array.dtype} {array.shape}, the header says float32 {shape}")
            f.write(np.ascontiguousarray(array, dtype="<f4").data)
            del array  # before the next one is made
    if next(arrays, None) is not None:
        raise ValueError(f"more arrays than the {len(specs)} tensors in the header")


def _safetensors_header(specs: Sequence[tuple[str, tuple[int, ...]]]) -> bytes:
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in specs:
        if name in header:
            raise ValueError(f"tensor {name} is listed twice")
        end = offset + math.prod(shape) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    blob = json.dumps(header, separators=(",", ":")).encode()
    return blob + b" " * (-(len(blob) + 8) % 8)  # the data starts 8-byte aligned


def cpu_has_native_bf16() -> bool:
    """True when torch's CPU kernels run bf16 matmuls natively (AMX or AVX512-BF16; see
    ``radixengine.utils.cpu_bf16``)."""
    return bf16_matmul_support().native


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """`auto`: bfloat16 on CUDA, and on a CPU that multiplies bf16 natively; else float32."""
    return resolve_dtype_with_reason(dtype, device)[0]


def resolve_dtype_with_reason(dtype: str, device: str) -> tuple[torch.dtype, str]:
    """The compute dtype and why (``/get_server_info`` names both)."""
    if dtype != "auto":
        chosen = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        return chosen, f"--dtype {dtype}"
    if device == "cuda":
        return torch.bfloat16, "--dtype auto on CUDA"
    if cpu_has_native_bf16():
        return (
            torch.bfloat16,
            f"--dtype auto: {bf16_matmul_support().reason}, whose bf16 matmul beats float32",
        )
    return torch.float32, (
        f"--dtype auto: {bf16_matmul_support().reason}, so bf16 matmuls would run without native "
        "bf16 products; float32 arithmetic (16-bit weights stay 16-bit where they hold bf16 values)"
    )
