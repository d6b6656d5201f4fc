"""Tiny GGUF files for tests, written the way llama.cpp's `convert_hf_to_gguf.py` writes a Llama:
q/k rows permuted, Llama-3 RoPE factors as a `rope_freqs` tensor, a byte-level vocabulary."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

# HF name (after "model.layers.N.") -> GGUF name (after "blk.N.")
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    base, _, suffix = hf_name.rpartition(".")
    if base.startswith("model.layers."):
        layer, _, rest = base.removeprefix("model.layers.").partition(".")
        return f"blk.{layer}.{_LAYER_NAMES[rest]}.{suffix}"
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (HF half-split rotary pairs -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(config) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp writes for a Llama 3.1 rope: per frequency, the number
    its inverse frequency is divided by."""
    rope = dict(config.rope_parameters)
    dim = config.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_llama_gguf(
    path: Path,
    hf_model: torch.nn.Module,
    qtype: int = 0,
    rope_freqs: np.ndarray | None = None,
    tensors: dict[str, np.ndarray] | None = None,
    rope_scaling: tuple[str, float] | None = None,
    qtypes: dict[str, int] | None = None,
) -> Path:
    """`hf_model` (a transformers LlamaForCausalLM) as a GGUF: matrices in `qtype` (a
    `gguf.GGMLQuantizationType`, F32 by default), norms in F32. `qtypes` gives some matrices
    another type, keyed by their GGUF name without suffix (`blk.0.ffn_up`) or also without layer
    (`attn_v`, `ffn_down`, `token_embd`, `output`). `tensors` overrides the float values of some HF-named tensors before
    they are written; `rope_scaling` is written as the `rope.scaling.type` and `.factor`
    metadata."""
    import gguf

    config = hf_model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_metadata(writer, config)
    if rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        writer.add_rope_scaling_factor(rope_scaling[1])
    _write_vocab(writer, config.vocab_size)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for name, value in hf_model.state_dict().items():
        if "rotary_emb" in name or (config.tie_word_embeddings and name == "lm_head.weight"):
            continue
        w = (tensors or {}).get(name, value.detach().float().numpy())
        if name.endswith("q_proj.weight"):
            w = permute_qk(w, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = permute_qk(w, config.num_key_value_heads)
        target = gguf_name(name)
        base = target.rsplit(".", 1)[0]
        types = qtypes or {}
        target_type = types.get(base, types.get(base.rsplit(".", 1)[-1], qtype))
        _add_tensor(writer, target, np.ascontiguousarray(w, dtype=np.float32), target_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tensor(writer, name: str, w: np.ndarray, qtype: int) -> None:
    import gguf

    if w.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, w)
        return
    q = quantize(w, qtype)
    writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType(qtype))


def quantize(w: np.ndarray, qtype: int) -> np.ndarray:
    """`w` [rows, cols] float32 as GGUF blocks, uint8 [rows, row bytes]: gguf-py's quantizer where
    it has one, else (Q4_K, Q5_K, Q6_K) `quantize_k`."""
    import gguf

    qtype = gguf.GGMLQuantizationType(qtype)
    if qtype in K_QUANTIZERS:
        return quantize_k(w, qtype)
    return gguf.quants.quantize(w, qtype)


# ------------------------------------------------------------------------------------------------
# K-quants, which gguf-py reads but does not write: blocks made by the format's definition (round
# to nearest with per-sub-block scales; not llama.cpp's error-minimising search).

QK_K = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _scale_codes(values: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-super-block fp16 `d` and integer codes with `d * code ~ values` (codes 0..levels)."""
    top = values.max(axis=-1, keepdims=True)
    d = _f16(top / levels)
    safe = np.where(d == 0, 1, d.astype(np.float32))
    codes = np.clip(np.rint(values / safe), 0, levels).astype(np.int32)
    return d, np.where(d == 0, 0, codes)


def _quants(x: np.ndarray, scale: np.ndarray, offset: np.ndarray, top: int) -> np.ndarray:
    safe = np.where(scale == 0, 1, scale)
    return np.where(scale == 0, 0, np.clip(np.rint((x + offset) / safe), 0, top)).astype(np.uint8)


def _q45_k_blocks(x: np.ndarray, bits: int) -> np.ndarray:
    """x [n, 256] -> Q4_K (bits 4) or Q5_K (bits 5) super-blocks."""
    n, top = x.shape[0], (1 << bits) - 1
    sub = x.reshape(n, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0)
    d, sc = _scale_codes((sub.max(axis=-1) - low) / top, 63)
    dmin, m = _scale_codes(-low, 63)
    scale = (d.astype(np.float32) * sc)[..., None]
    offset = (dmin.astype(np.float32) * m)[..., None]
    q = _quants(sub, scale, offset, top)
    packed = np.zeros((n, 12), dtype=np.uint8)
    packed[:, 0:4] = (sc[:, :4] | (sc[:, 4:] >> 4) << 6).astype(np.uint8)
    packed[:, 4:8] = (m[:, :4] | (m[:, 4:] >> 4) << 6).astype(np.uint8)
    packed[:, 8:12] = ((sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4).astype(np.uint8)
    nib = q & 15
    qs = (nib[:, 0::2] | nib[:, 1::2] << 4).reshape(n, 128)
    parts = [d.view(np.uint8), dmin.view(np.uint8), packed]
    if bits == 5:
        high = (q >> 4).astype(np.uint8)  # [n, 8, 32]
        parts.append((high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8))
    return np.concatenate([*parts, qs], axis=-1)


def _q6_k_blocks(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    amax = np.abs(sub).max(axis=-1)
    d = _f16(amax.max(axis=-1, keepdims=True) / 31 / 127)
    safe = np.where(d == 0, 1, d.astype(np.float32))
    sc = np.where(d == 0, 0, np.clip(np.rint(amax / 31 / safe), 0, 127)).astype(np.int8)
    scale = (d.astype(np.float32) * sc)[..., None]
    q = _quants(sub, scale, 32 * scale, 63).reshape(n, 2, 4, 32)  # [n, h, s, i]
    ql = np.zeros((n, 2, 2, 32), dtype=np.uint8)  # [n, h, s % 2, i]
    for s in range(4):
        ql[:, :, s % 2] |= (q[:, :, s] & 15) << (4 * (s // 2))
    qh = np.zeros((n, 2, 32), dtype=np.uint8)
    for s in range(4):
        qh |= (q[:, :, s] >> 4) << (2 * s)
    return np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d.view(np.uint8)], axis=-1
    )


K_QUANTIZERS = {12: lambda x: _q45_k_blocks(x, 4), 13: lambda x: _q45_k_blocks(x, 5), 14: _q6_k_blocks}


def quantize_k(w: np.ndarray, qtype: int) -> np.ndarray:
    """`w` [rows, cols] (cols a multiple of 256) as Q4_K (12), Q5_K (13) or Q6_K (14) blocks."""
    rows, cols = w.shape
    if cols % QK_K:
        raise ValueError(f"{cols} columns are not a whole number of {QK_K}-weight super-blocks")
    blocks = K_QUANTIZERS[int(qtype)](np.asarray(w, dtype=np.float32).reshape(-1, QK_K))
    return np.ascontiguousarray(blocks.reshape(rows, cols // QK_K * blocks.shape[-1]))


def _write_metadata(writer, config) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)


def _write_vocab(writer, vocab_size: int) -> None:
    """A byte-level BPE vocabulary of single bytes (`vocab_size` must be 256), no merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    if vocab_size != 256:
        raise ValueError("the test vocabulary has exactly the 256 bytes")
    spelling = bytes_to_unicode()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([spelling[b] for b in range(256)])
    writer.add_token_types([1] * 256)
    writer.add_token_scores([0.0] * 256)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
