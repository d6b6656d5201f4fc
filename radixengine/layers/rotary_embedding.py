"""Rotary position embedding (neox style, as HF Llama/Qwen), with linear and Llama-3 scaling, or
per-frequency factors (llama.cpp's `rope_freqs` tensor, which a GGUF carries instead of a
Llama-3 scaling)."""

from __future__ import annotations

import math

import torch
from torch import nn

from radixengine.layers.attention import native_cpu_ops
from radixengine.layers.native_small_ops import runs_native

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
        inv_freq = _scaled_inv_freq(_base_inv_freq(base, rotary_dim), scaling)
        t = torch.arange(max_position_embeddings, dtype=torch.float)
        freqs = t[:, None] * inv_freq[None, :]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        # cos/sin of the last positions tensor: every layer of one forward shares it.
        self._last: tuple | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate `x` `[num_tokens, num_heads, head_size]` at `positions` `[num_tokens]`.

        The model passes q and k heads together (adjacent in the fused qkv output), so one call
        rotates both. On the native CPU path `x` is rotated in place and returned."""
        if self._runs_native(positions, x):
            native_cpu_ops.rotary_embedding(positions, x, self.cos_sin_cache, self.rotary_dim)
            return x
        cos, sin = self._cos_sin(positions)
        rot = x[..., : self.rotary_dim]
        half = self.rotary_dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        if self.rotary_dim < self.head_size:
            out = torch.cat((out, x[..., self.rotary_dim :]), dim=-1)
        return out

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


def rope_config(config) -> tuple[float, dict | None]:
    """`(rope_theta, scaling dict or None)` from an HF config, old or new style; a config with
    `rope_freq_factors` (see `FREQ_FACTORS`) gets a scaling of that type."""
    params = dict(getattr(config, "rope_parameters", None) or {})
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
    return float(theta), (None if rope_type == "default" else params)


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
        _ROPE_CACHE[key] = RotaryEmbedding(head_size, rotary_dim, max_position, base, dtype, rope_scaling)
    return _ROPE_CACHE[key]
