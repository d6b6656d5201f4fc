"""Linear layers over GGUF block-quantized weights, kept in their GGUF blocks.

A weight [N, K] is stored as its raw blocks, ``qweight`` uint8 ``[N, K / block_weights *
block_bytes]``: row n is its blocks in order. Blocks of 32 weights (d, m fp16 scales; q the
quants):

- Q4_0 (18 bytes): d, 16 bytes of nibbles; weight j < 16 is ``d * ((qs[j] & 15) - 8)``, weight
  16 + j ``d * ((qs[j] >> 4) - 8)``.
- Q4_1 (20 bytes): d, m, 16 bytes of nibbles; ``d * q + m``, q the nibbles as in Q4_0.
- Q5_0 (22 bytes): d, 32-bit qh, nibbles; ``d * (q - 16)``, q the nibble plus 16 x bit j of qh.
- Q5_1 (24 bytes): d, m, qh, nibbles; ``d * q + m``, q as in Q5_0.
- Q8_0 (34 bytes): d, 32 int8 q; ``q * d``.

K-quants: super-blocks of 256 weights in sub-blocks with their own scales.

- Q4_K (144 bytes): d, dmin, 12 bytes of 6-bit sub-block scales sc and mins m (8 sub-blocks of
  32), 128 bytes of nibbles (sub-blocks 2c, 2c + 1: the low, high nibbles of bytes 32c ..
  32c + 31); ``(d * sc) * q - dmin * m``.
- Q5_K (176 bytes): as Q4_K with 32 bytes qh before the nibbles; bit j of qh[i] adds 16 to
  weight i of sub-block j.
- Q6_K (210 bytes): 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 sub-block
  scales (16 sub-blocks of 16), d; ``(d * scale) * (q - 32)``.

``dequantize_reference`` reproduces ``gguf.quants.dequantize`` bit for bit; ``quant_linear`` computes
``x @ W.T`` with the native kernel (``radixengine/csrc/cpu_quant_linear.cpp``), which reads the
blocks instead of a dequantized fp32 copy (6x fewer bytes for Q4_1) and equals the reference up to
fp32 summation order. Without the native extension it falls back to the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixengine.layers.attention import native_cpu_ops

__all__ = [
    "BLOCK_BYTES",
    "BLOCK_WEIGHTS",
    "GGML_Q4_0",
    "GGML_Q4_1",
    "GGML_Q4_K",
    "GGML_Q5_0",
    "GGML_Q5_1",
    "GGML_Q5_K",
    "GGML_Q6_K",
    "GGML_Q8_0",
    "GGML_TYPES",
    "QK",
    "QK_K",
    "QTYPE_NAMES",
    "dequantize_reference",
    "quant_linear",
    "quant_linear_reference",
    "quant_native_available",
    "supported_qtype",
]

GGML_Q4_0 = 2
GGML_Q4_1 = 3
GGML_Q5_0 = 6
GGML_Q5_1 = 7
GGML_Q8_0 = 8
GGML_Q4_K = 12
GGML_Q5_K = 13
GGML_Q6_K = 14
QK = 32  # weights per block
QK_K = 256  # weights per K-quant super-block


@dataclass(frozen=True)
class BlockFormat:
    name: str
    weights: int
    bytes: int


FORMATS = {
    GGML_Q4_0: BlockFormat("Q4_0", QK, 18),
    GGML_Q4_1: BlockFormat("Q4_1", QK, 20),
    GGML_Q5_0: BlockFormat("Q5_0", QK, 22),
    GGML_Q5_1: BlockFormat("Q5_1", QK, 24),
    GGML_Q8_0: BlockFormat("Q8_0", QK, 34),
    GGML_Q4_K: BlockFormat("Q4_K", QK_K, 144),
    GGML_Q5_K: BlockFormat("Q5_K", QK_K, 176),
    GGML_Q6_K: BlockFormat("Q6_K", QK_K, 210),
}
BLOCK_BYTES = {qtype: f.bytes for qtype, f in FORMATS.items()}
BLOCK_WEIGHTS = {qtype: f.weights for qtype, f in FORMATS.items()}
QTYPE_NAMES = {qtype: f.name for qtype, f in FORMATS.items()}
GGML_TYPES = {f.name: qtype for qtype, f in FORMATS.items()}


_native = native_cpu_ops.native_module_with("quant_linear")


def quant_native_available() -> bool:
    """True when the native extension is built with the quantized linear kernel."""
    return _native is not None


def supported_qtype(qtype: int) -> bool:
    """Whether ``qtype`` (a GGML type id) is a block format handled here."""
    return qtype in FORMATS


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

    As gguf-py: the scales widen exactly from fp16, products are rounded fp32 multiplies (exact:
    at most 23 significant bits) and an offset a separate rounded fp32 add or subtract.
    """
    block_bytes = _check_qweight(qweight, qtype)
    num_rows, row_bytes = qweight.shape
    shape = (num_rows, row_bytes // block_bytes * BLOCK_WEIGHTS[qtype])
    if qweight.numel() == 0:
        return torch.zeros(shape)
    blocks = qweight.reshape(num_rows * (row_bytes // block_bytes), block_bytes)
    return _DEQUANTIZE[qtype](blocks).reshape(shape)


def _fp16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of each block, as float32 [blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[blocks, 16] bytes -> [blocks, 32] quants: low nibbles, then high nibbles (int32)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1).int()


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """[blocks, 4] bytes (a little-endian uint32) -> [blocks, 32] bits x 16 (int32)."""
    shifts = torch.arange(8, dtype=torch.int32)
    bits = (qh.int().unsqueeze(-1) >> shifts) & 1
    return bits.reshape(qh.shape[0], 32) << 4


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _fp16(b, 0) * (_nibbles(b[:, 2:]) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return (_fp16(b, 0) * _nibbles(b[:, 4:]).float()) + _fp16(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _fp16(b, 0) * ((_nibbles(b[:, 6:]) | _fifth_bits(b[:, 2:6])) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return (_fp16(b, 0) * (_nibbles(b[:, 8:]) | _fifth_bits(b[:, 4:8])).float()) + _fp16(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _fp16(b, 0)


def _k_scales_mins(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: (d * sc, dmin * m) per sub-block, [blocks, 8, 1] each."""
    s = b[:, 4:16].int()
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)), dim=-1).float()
    m = torch.cat((mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)), dim=-1).float()
    return (_fp16(b, 0) * sc).unsqueeze(-1), (_fp16(b, 2) * m).unsqueeze(-1)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[blocks, 128] bytes -> [blocks, 8, 32]: sub-blocks 2c, 2c + 1 from bytes 32c .. 32c + 31."""
    chunks = qs.reshape(qs.shape[0], 4, 1, 32).int()
    return ((chunks >> torch.tensor([0, 4], dtype=torch.int32).reshape(1, 1, 2, 1)) & 0x0F).reshape(
        qs.shape[0], 8, 32
    )


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    scale, offset = _k_scales_mins(b)
    return scale * _k_nibbles(b[:, 16:]).float() - offset


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    scale, offset = _k_scales_mins(b)
    qh = b[:, 16:48].int().unsqueeze(1) >> torch.arange(8, dtype=torch.int32).reshape(1, 8, 1)
    q = _k_nibbles(b[:, 48:]) | ((qh & 1) << 4)
    return scale * q.float() - offset


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, 0:128].int().reshape(n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.int32).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32).reshape(1, 1, 4, 1)
    qh = ((b[:, 128:192].int().reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 8, 32)
    q = ((ql | (qh << 4)) - 32).reshape(n, 16, 16).float()
    scale = (_fp16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()).unsqueeze(-1)
    return scale * q


_DEQUANTIZE = {
    GGML_Q4_0: _q4_0,
    GGML_Q4_1: _q4_1,
    GGML_Q5_0: _q5_0,
    GGML_Q5_1: _q5_1,
    GGML_Q8_0: _q8_0,
    GGML_Q4_K: _q4_k,
    GGML_Q5_K: _q5_k,
    GGML_Q6_K: _q6_k,
}


def quant_linear_reference(x: torch.Tensor, qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """``F.linear(x, W)`` with W the dequantized weight [N, K] (no bias)."""
    return F.linear(x, dequantize_reference(qweight, qtype))


def _check_x(x: torch.Tensor, qweight: torch.Tensor, qtype: int) -> None:
    block_bytes = _check_qweight(qweight, qtype)
    if x.dtype != torch.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (..., K)")
    in_features, block_weights = x.shape[-1], BLOCK_WEIGHTS[qtype]
    if in_features % block_weights != 0:
        raise ValueError(f"in_features K = {in_features} is not a multiple of the block size {block_weights}")
    expected = in_features // block_weights * block_bytes
    if qweight.shape[1] != expected:
        raise ValueError(
            f"qweight rows hold {qweight.shape[1]} bytes but K = {in_features} needs {expected} "
            f"({in_features // block_weights} {QTYPE_NAMES[qtype]} blocks of {block_bytes} bytes)"
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
