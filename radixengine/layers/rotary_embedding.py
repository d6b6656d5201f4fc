"""Rotary position embedding (neox style, as HF Llama/Qwen), with linear and Llama-3 scaling, or
per-frequency factors (llama.cpp's `rope_freqs` tensor, which a GGUF carries instead of a
Llama-3 scaling), or Phi-3's longrope (`LongRopeRotaryEmbedding`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixengine.layers.attention import native_cpu_ops
from radixengine.layers.native_small_ops import runs_native
from radixengine.layers.triton_ops import use_fused_ops

if TYPE_CHECKING:
    from radixengine.layers.attention.base_attn_backend import FusedSetKVBufferArg
    from radixengine.layers.forward_batch_view import ForwardBatchView

# A config attribute: per rotary frequency, the number its inverse frequency is divided by
# (llama.cpp's `rope_freqs` tensor; the GGUF loader copies it there). Its scaling type:
FREQ_FACTORS_ATTR = "rope_freq_factors"
FREQ_FACTORS = "freq_factors"


class RotaryEmbedding(nn.Module):
    """Applies RoPE from a `[max_position, rotary_dim]` cache (cos half | sin half)."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        dtype: torch.dtype,
        scaling: dict | None = None,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.register_buffer("cos_sin_cache", self._make_cache(base, scaling).to(dtype), persistent=False)
        # cos/sin of the last positions tensor: every layer of one forward shares it.
        self._last: tuple | None = None

    def _make_cache(self, base: float, scaling: dict | None) -> torch.Tensor:
        inv_freq = _scaled_inv_freq(_base_inv_freq(base, self.rotary_dim), scaling)
        return _cos_sin(inv_freq, self.max_position_embeddings)

    def cache_positions(self, positions: torch.Tensor, forward_batch: ForwardBatchView) -> torch.Tensor:
        """The rows of `cos_sin_cache` the tokens at `positions` read (the positions themselves)."""
        return positions

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        fused_set_kv_buffer_arg: FusedSetKVBufferArg | None = None,
    ) -> torch.Tensor:
        """Rotate `x` `[num_tokens, num_heads, head_size]` at `positions` `[num_tokens]`.

        The model passes q and k heads together (adjacent in the fused qkv output), so one call
        rotates both. On the native CPU path and the Triton one (CUDA) `x` is rotated in place
        and returned. `fused_set_kv_buffer_arg` (on the Triton path only: `runs_triton`): the
        same launch writes the rotated k heads and v into the KV pool."""
        if self._runs_native(positions, x):
            native_cpu_ops.rotary_embedding(positions, x, self.cos_sin_cache, self.rotary_dim)
            return x
        if self._fits_triton(x):
            from radixengine.layers.triton_ops import rope_kv

            kv = fused_set_kv_buffer_arg
            if kv is None:
                return rope_kv.rotary_in_place(positions, x, self.cos_sin_cache, self.rotary_dim)
            args = (kv.value, kv.k_buffer, kv.v_buffer, kv.cache_loc)
            return rope_kv.rotary_store_kv(positions, x, self.cos_sin_cache, self.rotary_dim, *args)
        if fused_set_kv_buffer_arg is not None:
            raise ValueError("a K/V write fused with the rotary needs the Triton path (runs_triton)")
        cos, sin = self._cos_sin(positions)
        rot = x[..., : self.rotary_dim]
        half = self.rotary_dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        if self.rotary_dim < self.head_size:
            out = torch.cat((out, x[..., self.rotary_dim :]), dim=-1)
        return out

    def runs_triton(self, positions: torch.Tensor, x: torch.Tensor) -> bool:
        """`forward` rotates `x` with the Triton kernel (which can write the K/V too)."""
        return self._fits_triton(x) and not self._runs_native(positions, x)

    def _fits_triton(self, x: torch.Tensor) -> bool:
        return use_fused_ops(x) and x.dtype == self.cos_sin_cache.dtype and x.dim() == 3 and x.stride(2) == 1

    def _runs_native(self, positions: torch.Tensor, x: torch.Tensor) -> bool:
        """The kernel takes the cache as it is stored (`[max_position, rotary_dim]`, cos | sin
        halves, neox style) in x's dtype, and `[tokens, heads, head_size]` rows of unit stride."""
        return runs_native(x, self.cos_sin_cache) and positions.is_cpu and x.dim() == 3 and x.stride(2) == 1

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        last = self._last
        if last is None or last[0] is not positions or last[1] != positions._version:
            cos, sin = self.cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
            last = self._last = (positions, positions._version, cos, sin)
        return last[2], last[3]


class LongRopeRotaryEmbedding(RotaryEmbedding):
    """Phi-3's longrope ("su"): the inverse frequencies divided by per-frequency `short_factor`s,
    or `long_factor`s for a sequence longer than `original_max_position_embeddings`, and cos/sin
    scaled by an attention factor. As transformers does it, the choice holds for a whole forward
    of a sequence: the tokens of a request whose length after this forward exceeds the original
    context read the long cache (rows `max_position` onwards), the others the short one."""

    def _make_cache(self, base: float, scaling: dict | None) -> torch.Tensor:
        self.original_max_position = int(scaling["original_max_position_embeddings"])
        factor = scaling.get("factor") or self.max_position_embeddings / self.original_max_position
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0
            if factor > 1.0:
                attention_factor = math.sqrt(1 + math.log(factor) / math.log(self.original_max_position))
        inv_freq = _base_inv_freq(base, self.rotary_dim)
        caches = [
            _cos_sin(_divided_inv_freq(inv_freq, scaling[name]), self.max_position_embeddings)
            * attention_factor
            for name in ("short_factor", "long_factor")
        ]
        return torch.cat(caches)

    def cache_positions(self, positions: torch.Tensor, forward_batch: ForwardBatchView) -> torch.Tensor:
        if forward_batch.forward_mode.is_decode():
            seq_lens = positions + 1
        else:
            seq_lens = torch.repeat_interleave(
                forward_batch.seq_lens, forward_batch.extend_seq_lens, output_size=positions.numel()
            )
        return positions + (seq_lens > self.original_max_position) * self.max_position_embeddings


def _cos_sin(inv_freq: torch.Tensor, max_position: int) -> torch.Tensor:
    """`[max_position, rotary_dim]`: cos | sin of each position times each inverse frequency."""
    t = torch.arange(max_position, dtype=torch.float)
    freqs = t[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == FREQ_FACTORS:
        return _divided_inv_freq(inv_freq, scaling["freq_factors"])
    raise ValueError(f"unsupported rope scaling type {rope_type!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _divided_inv_freq(inv_freq: torch.Tensor, factors) -> torch.Tensor:
    """llama.cpp's rope: each inverse frequency divided by its factor."""
    factors = torch.tensor(list(factors), dtype=torch.float32)
    if factors.shape != inv_freq.shape:
        raise ValueError(f"{len(factors)} rope frequency factors for {len(inv_freq)} rotary frequencies")
    return inv_freq / factors


def rope_config(config, layer_type: str | None = None) -> tuple[float, dict | None]:
    """`(rope_theta, scaling dict or None)` from an HF config, old or new style, for the layers of
    `layer_type` when the config has parameters per layer type (Gemma 3); a config with
    `rope_freq_factors` (see `FREQ_FACTORS`) gets a scaling of that type."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    legacy = getattr(config, "rope_scaling", None)
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    factors = getattr(config, FREQ_FACTORS_ATTR, None)
    if factors is not None:
        if rope_type != "default":
            raise ValueError(
                f"a config with {FREQ_FACTORS_ATTR} must not also have a {rope_type!r} rope scaling"
            )
        return float(theta), {"rope_type": FREQ_FACTORS, "freq_factors": tuple(float(f) for f in factors)}
    if rope_type in LONGROPE_TYPES:
        original = getattr(config, "original_max_position_embeddings", None)
        params.setdefault("original_max_position_embeddings", original)
    return float(theta), (None if rope_type == "default" else params)


def partial_rotary_dim(config, head_dim: int) -> int:
    """The features of each head that rotate (Phi-4-mini's `partial_rotary_factor` < 1)."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)) or 1.0
    return int(head_dim * factor)


LONGROPE_TYPES = ("longrope", "su")
_ROPE_CACHE: dict[tuple, RotaryEmbedding] = {}


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict | None = None,
    dtype: torch.dtype | None = None,
) -> RotaryEmbedding:
    """A RotaryEmbedding, shared by every layer (and model) with the same parameters."""
    dtype = dtype or torch.get_default_dtype()
    scaling_key = tuple(sorted((k, str(v)) for k, v in (rope_scaling or {}).items()))
    key = (head_size, rotary_dim, max_position, base, scaling_key, dtype, str(torch.get_default_device()))
    if key not in _ROPE_CACHE:
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type"))
        cls = LongRopeRotaryEmbedding if rope_type in LONGROPE_TYPES else RotaryEmbedding
        _ROPE_CACHE[key] = cls(head_size, rotary_dim, max_position, base, dtype, rope_scaling)
    return _ROPE_CACHE[key]
