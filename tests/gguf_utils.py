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
) -> Path:
    """`hf_model` (a transformers LlamaForCausalLM) as a GGUF: matrices in `qtype` (a
    `gguf.GGMLQuantizationType`, F32 by default), norms in F32. `tensors` overrides the float
    values of some HF-named tensors before they are written; `rope_scaling` is written as the
    `rope.scaling.type` and `.factor` metadata."""
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
        _add_tensor(writer, gguf_name(name), np.ascontiguousarray(w, dtype=np.float32), qtype)
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
    q = gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype))
    writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType(qtype))


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
