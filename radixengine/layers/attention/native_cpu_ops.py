"""Native CPU ops over the paged KV pool, each with a pure-torch reference.

The KV cache is a paged pool: per layer K and V buffers ``[num_slots, num_kv_heads, head_dim]``
and ``req_to_token`` (int32 ``[max_reqs, max_context_len]``) mapping (request row, position) to a
slot. The native kernels (``radixengine/csrc``, built into ``radixengine._native_cpu_<level>``
by the package's set-up) read K/V through ``req_to_token`` in place; the references gather and
use ``scaled_dot_product_attention`` in fp32. A NaN in a K or V row a query attends over reaches
its output, as in the reference.

Besides attention and the KV write, the fused small ops of a decoder layer: ``rms_norm``,
``fused_add_rms_norm`` (in place) and ``rotary_embedding`` (in place, neox style); their
references are the torch expressions of ``radixengine/layers/layernorm.py`` and
``rotary_embedding.py``, rounding included.

Every op calls the native kernel when the extension is built and falls back to the reference
only when it is not: ``native_available()`` says which, and ``native_unavailable_reason()`` why.
Callers that need the native code (an explicitly requested native backend) call
``require_native()``, which raises.

The kernels are built once per instruction-set level (``radixengine._native_cpu_avx512``,
``_avx2``, ``_portable``; see ``radixengine/utils/cpu_isa.py``) and only the highest level this
CPU supports is imported (``RADIXENGINE_CPU_ISA`` may ask for a lower one); ``native_level()``
says which. Set ``RADIXENGINE_JIT_BUILD=1`` to compile that level on import with
``torch.utils.cpp_extension.load`` instead of importing the prebuilt module (for development).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import ParamSpec, TypeVar

import torch
import torch.nn.functional as F

from radixengine.utils import cpu_isa

logger = logging.getLogger(__name__)

__all__ = [
    "decode_attention",
    "decode_attention_cascade",
    "decode_attention_cascade_reference",
    "decode_attention_reference",
    "extend_attention",
    "extend_attention_reference",
    "fused_add_rms_norm",
    "fused_add_rms_norm_reference",
    "native_amx_available",
    "native_available",
    "native_isa",
    "native_level",
    "native_module_with",
    "load_native_level",
    "native_supports",
    "native_op",
    "native_unavailable_reason",
    "require_native",
    "rms_norm",
    "rms_norm_reference",
    "rotary_embedding",
    "rotary_embedding_reference",
    "set_kv_buffer",
    "set_kv_buffer_reference",
    "silu_and_mul",
    "silu_and_mul_reference",
]

P = ParamSpec("P")
R = TypeVar("R")
CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc"
NATIVE_DTYPES = (torch.float32, torch.bfloat16)
NATIVE_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def jit_build_options(level: str) -> dict:
    """Arguments of ``torch.utils.cpp_extension.load`` for one level: the level's flags (never
    -march=native) and a name, hence a build directory, of its own."""
    cpu_isa.check_level(level)
    return {
        "name": f"radixengine_native_cpu_{level}",
        "sources": sorted(str(p) for p in CSRC_DIR.glob("*.cpp")),
        "extra_cflags": ["-O3", *cpu_isa.COMPILE_FLAGS[level], "-fopenmp"],
        "extra_ldflags": ["-fopenmp"],
    }


def _jit_build(level: str) -> ModuleType:
    from torch.utils.cpp_extension import load

    verbose = os.environ.get("RADIXENGINE_JIT_VERBOSE") == "1"
    return load(**jit_build_options(level), verbose=verbose)


def load_native_level(level: str) -> ModuleType:
    """The prebuilt module of one level; refuses a level this CPU cannot run (importing it could
    end the process with SIGILL). ImportError when that level was not built."""
    if level not in cpu_isa.supported_levels():
        raise RuntimeError(f"this CPU cannot run the {level!r} native kernels")
    return importlib.import_module(cpu_isa.module_name(level))


def _import_prebuilt(level: str) -> tuple[ModuleType, str]:
    """The module of ``level``, or of the next lower level that was built."""
    missing = []
    for candidate in reversed(cpu_isa.LEVELS[: cpu_isa.LEVELS.index(level) + 1]):
        try:
            return load_native_level(candidate), candidate
        except ModuleNotFoundError as exc:
            if exc.name != cpu_isa.module_name(candidate):
                raise
            missing.append(exc.name)
    raise ModuleNotFoundError(f"no native CPU build ({', '.join(missing)} not found)")


def _load_native() -> tuple[ModuleType | None, str | None, str | None]:
    """(module, its level, None) or (None, None, why not)."""
    try:
        level, why = cpu_isa.chosen_level()
        if os.environ.get("RADIXENGINE_JIT_BUILD") == "1":
            module, loaded = _jit_build(level), level
        else:
            module, loaded = _import_prebuilt(level)
    except Exception as exc:  # ImportError, or a compiler error from the JIT build
        return None, None, f"{type(exc).__name__}: {exc}"
    if loaded != level:
        why = f"{why}; {level} not built"
    logger.info("native CPU kernels: %s (%s)", loaded, why)
    return module, loaded, None


_native, _native_level, _native_error = _load_native()


def native_available() -> bool:
    """True when the native extension is loaded (built by set-up, or JIT-built)."""
    return _native is not None


def native_unavailable_reason() -> str | None:
    """Why the native extension could not be loaded; None when it is loaded."""
    return _native_error


def require_native() -> ModuleType:
    """The native extension module; raises RuntimeError (with the reason) when it is missing."""
    if _native is None:
        raise RuntimeError(
            "radixengine native CPU ops are not available "
            f"({_native_error}); build them with `pip install --no-build-isolation -e .` "
            "or set RADIXENGINE_JIT_BUILD=1"
        )
    return _native


def native_module_with(kernel: str) -> ModuleType | None:
    """The native extension module when it is loaded and has `kernel` (a module built before
    that kernel existed has not); else None."""
    return _native if _native is not None and hasattr(_native, kernel) else None


def native_amx_available() -> bool:
    """Whether the loaded kernels may use AMX tiles here (bf16 cascade units, extend, linears)."""
    return _native is not None and hasattr(_native, "amx_available") and _native.amx_available()


def native_isa() -> str | None:
    """The vector code path the loaded module was compiled with ("avx512", "avx2", "portable")."""
    return _native.isa() if _native is not None else None


def native_level() -> str | None:
    """The instruction-set level whose module is loaded (see ``radixengine.utils.cpu_isa``)."""
    return _native_level


def native_supports(dtype: torch.dtype, head_dim: int, kv_dtype: torch.dtype | None = None) -> bool:
    """Whether the native attention ops handle this query dtype, KV cache dtype (default: the
    query's) and head size."""
    kv_ok = (kv_dtype or dtype) in NATIVE_KV_DTYPES
    return _native is not None and dtype in NATIVE_DTYPES and kv_ok and head_dim % 16 == 0 and head_dim <= 512


# ----------------------------------------------------------------------------------------------
# References (pure torch; fp32 math, output in q's dtype)


def _gather(buffer: torch.Tensor, req_to_token: torch.Tensor, row: int, length: int) -> torch.Tensor:
    slots = req_to_token[row, :length].to(torch.long)
    return buffer.index_select(0, slots).float()


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """q [Tq, H, D], k/v [Tk, Hkv, D] (fp32) -> [Tq, H, D]; scores soft-capped when logit_cap > 0."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if logit_cap > 0:
        scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / logit_cap) * logit_cap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), v).transpose(0, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)


def _first_key(pos: int, window_left: int) -> int:
    """The first key position a query at `pos` reads (a sliding window of `window_left`)."""
    return max(0, pos - window_left) if window_left >= 0 else 0


def decode_attention_reference(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_kv_splits: int = 0,
    window_left: int = -1,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """Attention of one new token per request over positions 0..seq_lens[i]-1 of its row (with
    `window_left` >= 0, only its last `window_left + 1`); `logit_cap` > 0 soft-caps the scores.

    q [bs, H, D]; k_buffer / v_buffer [num_slots, Hkv, D] (H % Hkv == 0); req_to_token int32
    [max_reqs, max_context_len]; req_pool_indices, seq_lens int64 [bs]. Returns [bs, H, D] in
    q's dtype. ``num_kv_splits`` > 0 forces that many KV splits (native only; 0 = automatic).
    """
    out = torch.zeros_like(q)
    for i, (row, length) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        if length == 0:
            continue
        first = _first_key(length - 1, window_left)
        k = _gather(k_buffer, req_to_token, row, length)[first:]
        v = _gather(v_buffer, req_to_token, row, length)[first:]
        out[i] = _sdpa(q[i : i + 1].float(), k, v, scale, None, logit_cap)[0].to(q.dtype)
    return out


def extend_attention_reference(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    scale: float,
    window_left: int = -1,
    logit_cap: float = 0.0,
    use_amx: bool = True,
    short_as_decode: bool = True,
) -> torch.Tensor:
    """Causal attention of the new tokens of each request over its cached prefix and themselves.

    q [T, H, D] holds request i's new tokens at rows extend_start_loc[i] ..
    + extend_seq_lens[i]; its token j (absolute position seq_lens[i] - extend_seq_lens[i] + j)
    attends over positions 0..that position, all read through the pool (the new tokens' K/V
    already written). With `window_left` >= 0 it sees only positions from that position minus
    `window_left`; `logit_cap` > 0 soft-caps the scores. Returns [T, H, D] in q's dtype
    (``use_amx``, ``short_as_decode``: the native kernel's switches, ignored here).
    """
    out = torch.zeros_like(q)
    for row, length, ext, start in zip(
        req_pool_indices.tolist(), seq_lens.tolist(), extend_seq_lens.tolist(), extend_start_loc.tolist()
    ):
        if ext == 0:
            continue
        k = _gather(k_buffer, req_to_token, row, length)
        v = _gather(v_buffer, req_to_token, row, length)
        mask = _extend_mask(length - ext, length, window_left)
        part = _sdpa(q[start : start + ext].float(), k, v, scale, mask, logit_cap)
        out[start : start + ext] = part.to(q.dtype)
    return out


def _extend_mask(prefix: int, length: int, window_left: int) -> torch.Tensor:
    """bool [length - prefix, length], True = visible: causal, within the window if any."""
    query_pos = torch.arange(prefix, length).unsqueeze(1)
    key_pos = torch.arange(length).unsqueeze(0)
    mask = key_pos <= query_pos
    if window_left >= 0:
        mask &= key_pos >= query_pos - window_left
    return mask


def _attend_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, logit_cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, H, D], k/v [L, Hkv, D] (fp32): every query over every key. Returns the output
    [n, H, D] and its log-sum-exp [n, H]."""
    n, heads, dim = q.shape
    num_kv = k.shape[1]
    qg = q.view(n, num_kv, heads // num_kv, dim).permute(1, 0, 2, 3).reshape(num_kv, -1, dim)
    scores = torch.matmul(qg, k.permute(1, 2, 0)) * scale  # [Hkv, n * G, L]
    if logit_cap > 0:
        scores = torch.tanh(scores / logit_cap) * logit_cap
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), v.permute(1, 0, 2))  # [Hkv, n * G, D]
    out = out.view(num_kv, n, -1, dim).permute(1, 0, 2, 3).reshape(n, heads, dim)
    return out, lse.view(num_kv, n, -1).permute(1, 0, 2).reshape(n, heads)


def decode_attention_cascade_reference(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    unit_rows: torch.Tensor,
    unit_start: torch.Tensor,
    unit_end: torch.Tensor,
    unit_member_ptr: torch.Tensor,
    unit_members: torch.Tensor,
    unit_member_slots: torch.Tensor,
    own_start: torch.Tensor,
    own_slot: torch.Tensor,
    num_kv_splits: int = 0,
    logit_cap: float = 0.0,
    use_amx: bool = True,
) -> torch.Tensor:
    """`decode_attention_reference` computed as the shared-prefix pass does (a plan of
    `radixengine.layers.attention.cascade_plan`): each unit's keys once for all its members'
    queries, each request's own keys alone, the parts merged by their log-sum-exp. The result
    equals the plain decode's (up to rounding). ``num_kv_splits`` and ``use_amx`` are the native
    kernel's (ignored here)."""
    qf = q.float()
    kv = _PagedKv(k_buffer, v_buffer, req_to_token, scale, logit_cap)
    parts = _shared_parts(kv, qf, unit_rows, unit_start, unit_end, unit_member_ptr, unit_members)
    rows, lens, firsts = req_pool_indices.tolist(), seq_lens.tolist(), own_start.tolist()
    for b in range(q.shape[0]):
        out, lse = kv.attend(qf[b : b + 1], rows[b], firsts[b], lens[b])
        parts[b].append((out[0], lse[0]))
    return _merge_parts(parts, q)


_Part = tuple[torch.Tensor, torch.Tensor]  # a request's output [H, D] over some keys, and its lse [H]


@dataclass
class _PagedKv:
    """The KV pool read through `req_to_token`, for the references."""

    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor
    scale: float
    logit_cap: float

    def attend(self, queries: torch.Tensor, row: int, start: int, end: int) -> _Part:
        """`queries` [n, H, D] (fp32) over the keys of positions [start, end) of `row`."""
        slots = self.req_to_token[row, start:end].to(torch.long)
        k, v = self.k_buffer.index_select(0, slots).float(), self.v_buffer.index_select(0, slots).float()
        return _attend_with_lse(queries, k, v, self.scale, self.logit_cap)


def _shared_parts(
    kv: _PagedKv,
    qf: torch.Tensor,
    unit_rows: torch.Tensor,
    unit_start: torch.Tensor,
    unit_end: torch.Tensor,
    unit_member_ptr: torch.Tensor,
    unit_members: torch.Tensor,
) -> list[list[_Part]]:
    """Per request, its parts over the shared prefixes: each unit's keys once for all its members."""
    parts: list[list[_Part]] = [[] for _ in range(qf.shape[0])]
    ptr = unit_member_ptr.tolist()
    for u, (row, start, end) in enumerate(zip(unit_rows.tolist(), unit_start.tolist(), unit_end.tolist())):
        members = unit_members[ptr[u] : ptr[u + 1]].to(qf.device)
        out, lse = kv.attend(qf.index_select(0, members), row, start, end)
        for j, b in enumerate(members.tolist()):
            parts[b].append((out[j], lse[j]))
    return parts


def _merge_parts(parts: list[list[_Part]], q: torch.Tensor) -> torch.Tensor:
    """Each request's parts merged by their log-sum-exp, in q's dtype."""
    result = torch.empty_like(q)
    for b in range(q.shape[0]):
        outs = torch.stack([o for o, _ in parts[b]])  # [P, H, D]
        lses = torch.stack([lse for _, lse in parts[b]])  # [P, H]
        weights = torch.softmax(lses, dim=0)
        result[b] = (weights.unsqueeze(-1) * outs).sum(0).to(q.dtype)
    return result


def set_kv_buffer_reference(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k_buffer[loc] = k and v_buffer[loc] = v, in place (loc int64 [T], k/v [T, Hkv, D])."""
    k_buffer.index_copy_(0, loc, k.to(k_buffer.dtype))
    v_buffer.index_copy_(0, loc, v.to(v_buffer.dtype))


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [tokens, hidden] rows, scaled by weight [hidden] (same dtype as x)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # Half precision: normalise in fp32, scale in the model dtype, as HF does.
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: residual = x + residual, then x = rms_norm(residual, weight, eps)."""
    residual.add_(x)
    x.copy_(rms_norm_reference(residual, weight, eps))


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :d]) * x[:, d:] for x [tokens, 2d] (the gated MLP's activation)."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def rotary_embedding_reference(
    positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor, rotary_dim: int
) -> None:
    """Neox-style rotary embedding of x [tokens, heads, head_dim] in place (x may be a strided view).

    cos_sin_cache [max_position, rotary_dim] holds cos | sin halves (x's dtype); positions int64 [tokens].
    """
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    half = rotary_dim // 2
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x[..., :rotary_dim] = out


# ----------------------------------------------------------------------------------------------
# Ops: native when built, else the reference. Each op is declared once, by its reference: the
# kernel of the same name takes the same parameters (radixengine/csrc/cpu_bindings.cpp).

OPS: dict[str, Callable] = {}  # op name -> its reference


def native_op(reference: Callable[P, R]) -> Callable[P, R]:
    """The op `reference` declares (its name without ``_reference``): the native kernel of that
    name when the extension is built, else `reference`, with the arguments as they are given."""
    name = reference.__name__.removesuffix("_reference")
    OPS[name] = reference

    def op(*args: P.args, **kwargs: P.kwargs) -> R:
        if _native is None:
            return reference(*args, **kwargs)
        return getattr(_native, name)(*args, **kwargs)

    functools.update_wrapper(op, reference)
    op.__name__ = op.__qualname__ = name
    return op


decode_attention = native_op(decode_attention_reference)
decode_attention_cascade = native_op(decode_attention_cascade_reference)
extend_attention = native_op(extend_attention_reference)
set_kv_buffer = native_op(set_kv_buffer_reference)
rms_norm = native_op(rms_norm_reference)
fused_add_rms_norm = native_op(fused_add_rms_norm_reference)
silu_and_mul = native_op(silu_and_mul_reference)
rotary_embedding = native_op(rotary_embedding_reference)
