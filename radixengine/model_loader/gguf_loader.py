"""GGUF → HF folder (config.json, model.safetensors, tokenizer files), cached per GGUF file.

Dequantizing a GGUF and converting its tokenizer takes many seconds; the result is stored in
`$RADIXENGINE_CACHE_DIR` (default `~/.cache/radixengine`) under a key made from the file's
first bytes and size, so later starts load a plain safetensors folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from radixengine.layers.rotary_embedding import FREQ_FACTORS_ATTR, rope_config

logger = logging.getLogger(__name__)

CONVERSION_VERSION = "2"  # 2: rope_freqs and linear rope scaling kept in the config
_HASH_PREFIX_BYTES = 16 << 20
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


def cache_root() -> Path:
    return Path(os.environ.get("RADIXENGINE_CACHE_DIR") or Path.home() / ".cache" / "radixengine")


def gguf_cache_key(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(_HASH_PREFIX_BYTES))
    h.update(f"|{os.path.getsize(path)}|v{CONVERSION_VERSION}".encode())
    return h.hexdigest()[:32]


def convert_gguf(path: str | os.PathLike) -> Path:
    """The HF folder for this GGUF, converting it on first use (one process at a time)."""
    target = cache_root() / gguf_cache_key(path)
    if (target / _DONE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(str(target) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / _DONE).exists():
            logger.info("converting %s to %s (once)", path, target)
            _convert_into(Path(path), target)
    return target


def _convert_into(path: Path, target: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        config = _save_config_and_tokenizer(path, tmp)
        from safetensors.torch import save_file

        save_file(dict(gguf_weights_iterator(path, config)), str(tmp / "model.safetensors"))
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


def gguf_weights_iterator(path: str | os.PathLike, config) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized float32 tensors with HF names; llama q/k rows un-permuted."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _field_str(reader, "general.architecture")
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            continue
        shape = tuple(reversed([int(d) for d in t.shape]))
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads
            if name.endswith("k_proj.weight"):
                heads = config.num_key_value_heads
            w = unpermute_qk(w, heads)
        yield name, torch.from_numpy(np.array(w, dtype=np.float32, order="C"))


def gguf_block_weights_iterator(
    path: str | os.PathLike, config, qtypes: frozenset[int]
) -> Iterator[tuple[str, int, torch.Tensor]]:
    """The tensors stored in one of `qtypes`, as they are in the file: `(hf_name, qtype, rows)`
    with `rows` uint8 `[out_features, in_features / block_size * block_bytes]` (each row its
    blocks), llama q/k rows un-permuted as in `gguf_weights_iterator`."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _field_str(reader, "general.architecture")
    for t in reader.tensors:
        qtype = int(t.tensor_type)
        name = hf_tensor_name(t.name)
        if qtype not in qtypes or name is None or t.data.ndim != 2:
            continue
        rows = t.data
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = (
                config.num_key_value_heads if name.endswith("k_proj.weight") else config.num_attention_heads
            )
            rows = unpermute_qk(rows, heads)
        yield name, qtype, torch.from_numpy(np.array(rows, dtype=np.uint8, order="C"))


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
