"""Linear layers over GGUF block-quantized weights (Q4_1, Q8_0), kept in their GGUF blocks.

A weight [N, K] is stored as its raw blocks, ``qweight`` uint8 ``[N, K / 32 * block_bytes]``: row n
is K / 32 consecutive blocks of 32 weights.

- Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles; weight j < 16 is ``d * (qs[j] & 15) + m``
  and weight 16 + j is ``d * (qs[j] >> 4) + m``.
- Q8_0 (34 bytes): fp16 d, 32 int8 q; weight j is ``q[j] * d``.

``dequantize_reference`` reproduces ``gguf.quants.dequantize`` bit for bit; ``quant_linear`` computes
``x @ W.T`` with the native kernel (``radixengine/csrc/cpu_quant_linear.cpp``), which reads the
blocks instead of a dequantized fp32 copy (6x fewer bytes for Q4_1) and equals the reference up to
fp32 summation order. Without the native extension it falls back to the reference.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from radixengine.layers.attention import native_cpu_ops

__all__ = [
    "BLOCK_BYTES",
    "GGML_Q4_1",
    "GGML_Q8_0",
    "QK",
    "dequantize_reference",
    "quant_linear",
    "quant_linear_reference",
    "quant_native_available",
    "supported_qtype",
]

GGML_Q4_1 = 3
GGML_Q8_0 = 8
QK = 32
BLOCK_BYTES = {GGML_Q4_1: 20, GGML_Q8_0: 34}
QTYPE_NAMES = {GGML_Q4_1: "Q4_1", GGML_Q8_0: "Q8_0"}


def _native_quant_module() -> ModuleType | None:
    if not native_cpu_ops.native_available():
        return None
    module = native_cpu_ops.require_native()
    return module if hasattr(module, "quant_linear") else None  # built before the kernel existed


_native = _native_quant_module()


def quant_native_available() -> bool:
    """True when the native extension is built with the quantized linear kernel."""
    return _native is not None


def supported_qtype(qtype: int) -> bool:
    """Whether ``qtype`` (a GGML type id) is a block format handled here."""
    return qtype in BLOCK_BYTES


def _check_qweight(qweight: torch.Tensor, qtype: int) -> int:
    """Validates qweight's type and layout; returns the block bytes of qtype."""
    if not supported_qtype(qtype):
        names = ", ".join(f"{name} = {t}" for t, name in QTYPE_NAMES.items())
        raise ValueError(f"unsupported GGML quantization type {qtype} (supported: {names})")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(
            f"qweight must be a uint8 [N, row_bytes] tensor of raw blocks, got {qweight.dtype} "
            f"{tuple(qweight.shape)}"
        )
    block_bytes = BLOCK_BYTES[qtype]
    if qweight.shape[1] % block_bytes != 0:
        raise ValueError(
            f"qweight rows hold {qweight.shape[1]} bytes, not a whole number of "
            f"{QTYPE_NAMES[qtype]} blocks ({block_bytes} bytes each)"
        )
    return block_bytes


def dequantize_reference(qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """The float32 weight [N, K] of raw blocks ``qweight``; bit-identical to gguf-py.

    As gguf-py: the scales widen exactly from fp16 and Q4_1 is a rounded fp32 multiply then a
    rounded fp32 add (separate torch ops), Q8_0 one fp32 multiply.
    """
    block_bytes = _check_qweight(qweight, qtype)
    num_rows, row_bytes = qweight.shape
    blocks = qweight.reshape(num_rows, row_bytes // block_bytes, block_bytes)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    if qtype == GGML_Q4_1:
        m = blocks[..., 2:4].contiguous().view(torch.float16).float()
        qs = blocks[..., 4:]
        q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()
        weights = (d * q) + m
    else:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        weights = q * d
    return weights.reshape(num_rows, row_bytes // block_bytes * QK)


def quant_linear_reference(x: torch.Tensor, qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """``F.linear(x, W)`` with W the dequantized weight [N, K] (no bias)."""
    return F.linear(x, dequantize_reference(qweight, qtype))


def _check_x(x: torch.Tensor, qweight: torch.Tensor, qtype: int) -> None:
    block_bytes = _check_qweight(qweight, qtype)
    if x.dtype != torch.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (..., K)")
    in_features = x.shape[-1]
    if in_features % QK != 0:
        raise ValueError(f"in_features K = {in_features} is not a multiple of the block size {QK}")
    expected = in_features // QK * block_bytes
    if qweight.shape[1] != expected:
        raise ValueError(
            f"qweight rows hold {qweight.shape[1]} bytes but K = {in_features} needs {expected} "
            f"({in_features // QK} {QTYPE_NAMES[qtype]} blocks of {block_bytes} bytes)"
        )


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """``x @ W.T`` for x float32 [..., K] and W [N, K] given as raw GGUF blocks; returns [..., N].

    Native kernel when the extension is built and the tensors are on the CPU, else the reference.
    Bad inputs raise ValueError.
    """
    if _native is None or not (x.is_cpu and qweight.is_cpu):
        _check_x(x, qweight, qtype)
        return quant_linear_reference(x, qweight, qtype)
    # The native op checks its inputs itself (a decode step makes about 120 of these calls, and
    # the Python checks cost several times the call); its errors get the Python message.
    try:
        if x.dim() == 2:
            return _native.quant_linear(x.contiguous(), qweight.contiguous(), qtype)
        rows = x.reshape(-1, x.shape[-1]) if x.dim() > 0 else x
        out = _native.quant_linear(rows.contiguous(), qweight.contiguous(), qtype)
        return out.reshape(*x.shape[:-1], qweight.shape[0])
    except RuntimeError:
        _check_x(x, qweight, qtype)
        raise
