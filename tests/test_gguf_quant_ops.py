"""The linear over GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): the pure-torch
dequantization is bit-identical to gguf-py, and the native kernel equals the reference (fp32, up
to summation order) on every path (few rows, many rows, odd shapes), on every instruction-set
level this CPU runs, and on the bundled model's own blocks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_utils import quantize

from radixengine.layers import gguf_quant_ops as ops
from radixengine.layers.gguf_quant_ops import GGML_Q4_1, GGML_Q8_0, QK_K
from radixengine.utils import cpu_isa

gguf = pytest.importorskip("gguf")
QTYPES = tuple(ops.FORMATS)
K_QTYPES = tuple(t for t in QTYPES if ops.BLOCK_WEIGHTS[t] == QK_K)
# Byte offsets of each type's fp16 scales in its block (d, and m / dmin where it has one).
SCALE_OFFSETS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}
needs_native = pytest.mark.skipif(
    not ops.quant_native_available(), reason="the native CPU kernels are not built"
)


def _name(qtype: int) -> str:
    return ops.QTYPE_NAMES[qtype]


def _blocks(rows: int, cols: int, qtype: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * scale
    return torch.from_numpy(quantize(w, qtype))


def _gguf_dequantize(q: torch.Tensor, qtype: int) -> torch.Tensor:
    return torch.from_numpy(
        np.ascontiguousarray(gguf.quants.dequantize(q.numpy(), gguf.GGMLQuantizationType(qtype)))
    )


def _cols(qtype: int, cols: int) -> int:
    """`cols` rounded up to a whole number of the type's blocks."""
    block = ops.BLOCK_WEIGHTS[qtype]
    return (cols + block - 1) // block * block


@pytest.mark.parametrize("qtype", QTYPES, ids=_name)
@pytest.mark.parametrize("scale", [1e-6, 1e-2, 1.0, 300.0])
def test_dequantize_reference_is_bit_identical(qtype, scale):
    q = _blocks(13, _cols(qtype, 96), qtype, seed=int(scale * 7) % 5, scale=scale)
    assert torch.equal(ops.dequantize_reference(q, qtype), _gguf_dequantize(q, qtype))


@pytest.mark.parametrize("qtype", K_QTYPES, ids=_name)
def test_k_quant_writer_round_trips(qtype):
    """The test's K-quant blocks (gguf-py cannot write them) dequantize, by gguf-py, close to
    the weights they were made from."""
    w = np.random.default_rng(qtype).standard_normal((16, 512)).astype(np.float32)
    back = gguf.quants.dequantize(quantize(w, qtype), gguf.GGMLQuantizationType(qtype))
    bound = {12: 0.25, 13: 0.12, 14: 0.08}[qtype]
    assert np.abs(back - w).max() < bound


@pytest.mark.parametrize("qtype", QTYPES, ids=_name)
def test_dequantize_reference_random_bytes(qtype):
    """Arbitrary block bytes: negative m, subnormal and large fp16 scales (no inf/nan)."""
    rng = np.random.default_rng(3)
    block = ops.BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, size=(64, 4 * block), dtype=np.uint8)
    blocks = raw.reshape(64, 4, block)
    scales = rng.standard_normal((64, 4, 2)).astype(np.float16)
    scales[:, 0, 0] = np.float16(3e-7)  # subnormal d
    scales[:, 1, 1] = -np.float16(1000.0)  # negative (m, dmin)
    for i, offset in enumerate(SCALE_OFFSETS[qtype]):
        blocks[..., offset : offset + 2] = scales[..., i : i + 1].view(np.uint8).reshape(64, 4, 2)
    q = torch.from_numpy(np.ascontiguousarray(blocks.reshape(64, -1)))
    assert torch.equal(ops.dequantize_reference(q, qtype), _gguf_dequantize(q, qtype))


@needs_native
@pytest.mark.parametrize("qtype", QTYPES, ids=_name)
@pytest.mark.parametrize("n,k", [(1, 32), (7, 576), (960, 576), (3072, 576), (576, 1536)])
def test_native_equals_reference(qtype, n, k):
    k = _cols(qtype, k)
    q = _blocks(n, k, qtype, seed=n + k)
    for m in (1, 2, 3, 4, 5, 8, 9, 12, 17, 32, 33, 64, 200):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        got, ref = ops.quant_linear(x, q, qtype), ops.quant_linear_reference(x, q, qtype)
        assert got.shape == (m, n)
        assert (got - ref).abs().max().item() <= 1e-5 * (1 + ref.abs().max().item()), (m, n, k)


@needs_native
def test_native_leading_dims_and_non_contiguous_input():
    q = _blocks(40, 64, GGML_Q4_1)
    x = torch.randn(3, 5, 128)[..., ::2]
    torch.testing.assert_close(
        ops.quant_linear(x, q, GGML_Q4_1), ops.quant_linear_reference(x, q, GGML_Q4_1), rtol=1e-5, atol=1e-5
    )


@needs_native
def test_native_on_the_bundled_model_blocks():
    from radixengine.model_loader import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    reader = gguf.GGUFReader(path)
    wanted = {"blk.0.ffn_down.weight", "token_embd.weight"}
    for t in (t for t in reader.tensors if t.name in wanted):
        q, qtype = torch.from_numpy(np.array(t.data)), int(t.tensor_type)
        assert torch.equal(ops.dequantize_reference(q, qtype), _gguf_dequantize(q, qtype))
        for m in (1, 32):
            x = torch.randn(m, q.shape[1] // ops.BLOCK_BYTES[qtype] * ops.BLOCK_WEIGHTS[qtype])
            got, ref = ops.quant_linear(x, q, qtype), ops.quant_linear_reference(x, q, qtype)
            assert (got - ref).abs().max().item() <= 1e-5 * (1 + ref.abs().max().item()), t.name


@pytest.mark.parametrize(
    "x, q, qtype, message",
    [
        (torch.randn(2, 64), torch.zeros(4, 40, dtype=torch.uint8), 10, "unsupported GGML quantization type"),
        (torch.randn(2, 64), torch.zeros(4, 40, dtype=torch.int8), GGML_Q4_1, "uint8"),
        (torch.randn(2, 64), torch.zeros(4, 41, dtype=torch.uint8), GGML_Q4_1, "whole number"),
        (torch.randn(2, 64).double(), torch.zeros(4, 40, dtype=torch.uint8), GGML_Q4_1, "float32"),
        (torch.randn(2, 48), torch.zeros(4, 40, dtype=torch.uint8), GGML_Q4_1, "multiple of the block size"),
        (torch.randn(2, 96), torch.zeros(4, 40, dtype=torch.uint8), GGML_Q4_1, "needs 60"),
        (torch.randn(2, 96), torch.zeros(4, 144, dtype=torch.uint8), 12, "multiple of the block size 256"),
        (torch.randn(2, 512), torch.zeros(4, 144, dtype=torch.uint8), 12, "needs 288"),
    ],
)
def test_bad_inputs_raise(x, q, qtype, message):
    with pytest.raises(ValueError, match=message):
        ops.quant_linear(x, q, qtype)


# ----------------------------------------------------------------------------------------------
# Every finite fp16 scale, the kernel's own dequantization, threads, edge shapes, native checks

FP16_EXPONENT = 0x7C00  # all ones: inf / nan


def _any_scale_blocks(rows: int, cols: int, qtype: int, seed: int) -> torch.Tensor:
    """Random block bytes whose fp16 scales are random finite bit patterns (subnormals, negative
    d and m, magnitudes up to 65504) plus a few fixed edge values."""
    gen = torch.Generator().manual_seed(seed)
    nblocks, block = cols // ops.BLOCK_WEIGHTS[qtype], ops.BLOCK_BYTES[qtype]
    raw = torch.randint(0, 256, (rows, nblocks, block), generator=gen, dtype=torch.uint8)
    offsets = SCALE_OFFSETS[qtype]
    bits = torch.randint(0, 1 << 16, (rows * nblocks * len(offsets),), generator=gen, dtype=torch.int32)
    edges = torch.tensor([0x0001, 0x03FF, 0x8001, 0x0400, 0x7BFF, 0xFBFF, 0x0000, 0x8000, 0x3C00, 0xBC00])
    bits[: edges.numel()] = edges
    bits = torch.where((bits & FP16_EXPONENT) == FP16_EXPONENT, bits & ~0x4000, bits)  # make finite
    scale_bytes = bits.to(torch.int16).view(torch.uint8).reshape(rows, nblocks, len(offsets), 2)
    for i, offset in enumerate(offsets):
        raw[..., offset : offset + 2] = scale_bytes[..., i, :]
    return raw.reshape(rows, -1).contiguous()


@pytest.mark.parametrize("qtype", QTYPES, ids=_name)
def test_dequantize_reference_every_finite_scale(qtype):
    q = _any_scale_blocks(67, _cols(qtype, 640), qtype, seed=qtype)
    blocks = q.reshape(67, -1, ops.BLOCK_BYTES[qtype])
    offset = SCALE_OFFSETS[qtype][0]
    scales = blocks[..., offset : offset + 2].contiguous().view(torch.float16).float()
    subnormal = (scales != 0) & (scales.abs() < 2.0**-14)
    assert subnormal.any() and (scales < 0).any() and (scales.abs() > 1e4).any()
    ours, theirs = ops.dequantize_reference(q, qtype), _gguf_dequantize(q, qtype)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))  # bit patterns, -0.0 included


def check_native_dequantization(qtype: int) -> None:
    """x = rows of the identity picks columns of W: the output must be W's values exactly (every
    finite scale), on the fused path (up to 12 rows) and the tiled one."""
    k, n = 512, 37
    q = _any_scale_blocks(n, k, qtype, seed=10 + qtype)
    w = _gguf_dequantize(q, qtype)
    gen = torch.Generator().manual_seed(qtype)
    for m in (1, 3, 4, 7, 12, 13, 40, k):
        columns = torch.randperm(k, generator=gen)[:m]
        assert torch.equal(ops.quant_linear(torch.eye(k)[columns], q, qtype), w[:, columns].T), (qtype, m)


@needs_native
@pytest.mark.parametrize("qtype", QTYPES, ids=_name)
def test_native_dequantization_is_bit_exact(qtype):
    check_native_dequantization(qtype)


def check_native_every_type() -> None:
    """Every block type on this process's native level: the bit-exact dequantization and the
    product with random x (fused and tiled paths) against the reference."""
    for qtype in QTYPES:
        check_native_dequantization(qtype)
        k = _cols(qtype, 768)
        q = _blocks(45, k, qtype, seed=qtype)
        for m in (1, 2, 5, 12, 13, 64):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            got, ref = ops.quant_linear(x, q, qtype), ops.quant_linear_reference(x, q, qtype)
            assert (got - ref).abs().max().item() <= 1e-5 * (1 + ref.abs().max().item()), (qtype, m)


@needs_native
@pytest.mark.parametrize("level", cpu_isa.supported_levels())
def test_native_every_type_on_every_isa_level(level):
    """The same checks in a fresh interpreter for each level this CPU runs (RADIXENGINE_CPU_ISA):
    the AVX-512, AVX2 and portable builds each dequantize and multiply every type correctly."""
    tests_dir = Path(__file__).resolve().parent
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(tests_dir)!r})\n"
        "from radixengine.layers.attention import native_cpu_ops\n"
        "import test_gguf_quant_ops as t\n"
        "t.check_native_every_type()\n"
        "print(native_cpu_ops.native_level())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RADIXENGINE_JIT_BUILD"}
    env[cpu_isa.ENV_VAR] = level
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1] == level


@needs_native
@pytest.mark.parametrize("m", [1, 6, 64])
def test_native_result_does_not_depend_on_thread_count(m):
    q = _blocks(700, 576, GGML_Q8_0, seed=m)
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.quant_linear(x, q, GGML_Q8_0)
        torch.set_num_threads(max(2, threads))
        many = ops.quant_linear(x, q, GGML_Q8_0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


@needs_native
@pytest.mark.parametrize("qtype", QTYPES, ids=_name)
def test_native_edge_shapes(qtype):
    for m, k, n in ((0, 64, 5), (3, 64, 0), (1, 4096, 3), (30, 160, 101), (13, 32, 1), (200, 1536, 7)):
        k = _cols(qtype, k)
        q = _blocks(n, k, qtype, seed=m + n)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
        got, ref = ops.quant_linear(x, q, qtype), ops.quant_linear_reference(x, q, qtype)
        assert got.shape == (m, n)
        if got.numel():
            assert (got - ref).abs().max().item() <= 1e-5 * (1 + ref.abs().max().item()), (m, k, n)


@needs_native
def test_native_op_checks_its_inputs():
    from radixengine.layers.attention.native_cpu_ops import require_native

    native, q = require_native(), torch.zeros(4, 40, dtype=torch.uint8)
    for x, weight, qtype, message in [
        (torch.randn(2, 64).double(), q, GGML_Q4_1, "x must be float32"),
        (torch.randn(2, 48), torch.zeros(4, 30, dtype=torch.uint8), GGML_Q4_1, "not a multiple of 32"),
        (torch.randn(2, 64), torch.zeros(4, 68, dtype=torch.uint8), GGML_Q4_1, "needs 40"),
        (torch.randn(2, 64), q, 10, "unsupported GGML type 10"),
        (torch.randn(2, 288), torch.zeros(4, 144, dtype=torch.uint8), 12, "not a multiple of 256"),
        (torch.randn(64, 2).T, q, GGML_Q4_1, "contiguous"),
        (torch.randn(2, 64), q.to(torch.int8), GGML_Q4_1, "qweight must be uint8"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            native.quant_linear(x, weight, qtype)
