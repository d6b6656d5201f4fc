"""GGUF → HF folder (config.json, model.safetensors, tokenizer files), cached per GGUF file.

Dequantizing a GGUF and converting its tokenizer takes many seconds; the result is stored in
`$RADIXENGINE_CACHE_DIR` (default `~/.cache/radixengine`) under a key made from the file's whole
content (see `gguf_cache`), so later starts load a plain safetensors folder. The weights are
dequantized and written one tensor at a time: a conversion holds one float32 tensor in memory,
never the whole model.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixengine.layers.rotary_embedding import FREQ_FACTORS_ATTR, rope_config
from radixengine.model_loader.gguf_cache import (
    cache_key,
    cache_root,
    content_digest,
    exclusive_lock,
    lock_path,
    remove_stale_temp_dirs,
    temp_dir_for,
)
from radixengine.model_loader.weight_utils import write_safetensors

logger = logging.getLogger(__name__)

# 2: rope_freqs and linear rope scaling kept in the config; 3: keyed on the whole file
CONVERSION_VERSION = "3"
_DONE = "conversion.done"

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_ROPE_FREQS = "rope_freqs.weight"  # Llama-3 rope factors: kept in the config, not a weight


def is_gguf(path: str | os.PathLike | None) -> bool:
    return path is not None and str(path).endswith(".gguf") and Path(path).is_file()


def gguf_cache_key(path: str | os.PathLike) -> str:
    """The cache folder's name for this GGUF: its whole content and the conversion version."""
    return cache_key(content_digest(path), f"v{CONVERSION_VERSION}")


def convert_gguf(path: str | os.PathLike) -> Path:
    """The HF folder for this GGUF, converting it on first use (one process at a time); first
    removes what conversions killed mid-way left in the cache."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(root)
    target = root / gguf_cache_key(path)
    if (target / _DONE).exists():
        return target
    with exclusive_lock(lock_path(target)):
        if not (target / _DONE).exists():
            logger.info("converting %s to %s (once)", path, target)
            _convert_into(Path(path), target)
    return target


def _convert_into(path: Path, target: Path) -> None:
    tmp = temp_dir_for(target)
    try:
        config = _save_config_and_tokenizer(path, tmp)
        _write_weights(path, config, tmp / "model.safetensors")
        (tmp / _DONE).write_text(str(path))
        tmp.chmod(0o755)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _save_config_and_tokenizer(path: Path, out: Path):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    arch = _ARCHITECTURES.get(config.model_type)
    if arch is None:
        raise ValueError(f"GGUF model type {config.model_type!r} is not supported")
    config.architectures = [arch]
    _set_rope_from_gguf(path, config)
    config.save_pretrained(out)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
    return config


def _set_rope_from_gguf(path: Path, config) -> None:
    """What transformers leaves out of a GGUF's config: a `rope_freqs` tensor (Llama 3.1/3.2's
    rope scaling as per-frequency divisors) becomes `config.rope_freq_factors`, and a linear
    `rope.scaling` its rope parameters; another scaling type is refused."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _field_str(reader, "general.architecture")
    scaling_type = _field_str(reader, f"{arch}.rope.scaling.type", default="none")
    if scaling_type == "linear":
        factor = float(reader.fields[f"{arch}.rope.scaling.factor"].contents())
        theta = rope_config(config)[0]
        config.rope_parameters = {"rope_type": "linear", "factor": factor, "rope_theta": theta}
    elif scaling_type != "none":
        raise ValueError(f"{path}: rope scaling {scaling_type!r} is not supported")
    freqs = [t for t in reader.tensors if t.name == _ROPE_FREQS]
    if freqs:
        values = np.asarray(freqs[0].data, dtype=np.float32).reshape(-1)
        setattr(config, FREQ_FACTORS_ATTR, [float(v) for v in values])


@dataclass(frozen=True)
class _Tensor:
    """A GGUF tensor under its HF name, with its shape in HF (row-major) order."""

    hf_name: str
    shape: tuple[int, ...]
    raw: Any  # gguf.ReaderTensor: the file's bytes, memory-mapped


def _hf_tensors(reader) -> list[_Tensor]:
    tensors = []
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is not None:
            tensors.append(_Tensor(name, tuple(reversed([int(d) for d in t.shape])), t))
    return tensors


def _dequantized(t: _Tensor, arch: str, config) -> np.ndarray:
    """One tensor as C-contiguous float32, llama q/k rows un-permuted."""
    import gguf

    w = np.asarray(gguf.quants.dequantize(t.raw.data, t.raw.tensor_type), dtype=np.float32).reshape(t.shape)
    if arch == "llama" and t.hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = (
            config.num_key_value_heads if t.hf_name.endswith("k_proj.weight") else config.num_attention_heads
        )
        w = unpermute_qk(w, heads)
    return np.ascontiguousarray(w)


def _write_weights(path: Path, config, out: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _field_str(reader, "general.architecture")
    tensors = _hf_tensors(reader)
    specs = [(t.hf_name, t.shape) for t in tensors]
    write_safetensors(out, specs, (_dequantized(t, arch, config) for t in tensors))


def gguf_weights_iterator(path: str | os.PathLike, config) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized float32 tensors with HF names, one at a time; llama q/k rows un-permuted."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _field_str(reader, "general.architecture")
    for t in _hf_tensors(reader):
        yield t.hf_name, torch.from_numpy(np.array(_dequantized(t, arch, config)))


def gguf_block_weights_iterator(
    path: str | os.PathLike, config, qtypes: frozenset[int]
) -> Iterator[tuple[str, str, int, torch.Tensor | None]]:
    """Every matrix of the file as `(hf_name, gguf_name, qtype, rows)`: for a type in `qtypes`,
    `rows` are its blocks as they are in the file, uint8 `[out_features, in_features /
    block_size * block_bytes]` (each row its blocks), llama q/k rows un-permuted as in
    `gguf_weights_iterator`; for another type `rows` is None."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _field_str(reader, "general.architecture")
    for t in reader.tensors:
        qtype = int(t.tensor_type)
        name = hf_tensor_name(t.name)
        if name is None or len(t.shape) != 2:
            continue
        if qtype not in qtypes:
            yield name, t.name, qtype, None
            continue
        rows = t.data
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = (
                config.num_key_value_heads if name.endswith("k_proj.weight") else config.num_attention_heads
            )
            rows = unpermute_qk(rows, heads)
        yield name, t.name, qtype, torch.from_numpy(np.array(rows, dtype=np.uint8, order="C"))


def hf_tensor_name(gguf_name: str) -> str | None:
    if gguf_name == _ROPE_FREQS:
        return None
    base, _, suffix = gguf_name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{suffix}"
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> HF half-split)."""
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _field_str(reader, key: str, default: str | None = None) -> str:
    field = reader.fields.get(key)
    if field is None and default is not None:
        return default
    if field is None:
        raise KeyError(f"GGUF field {key!r} is missing")
    return bytes(field.parts[field.data[0]]).decode()
