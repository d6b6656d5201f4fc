"""The linear over GGUF blocks: the pure-torch dequantization is bit-identical to gguf-py, and the
native kernel equals the reference (fp32, up to summation order) on every path (few rows, many
rows, odd shapes) and on the bundled model's own blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixengine.layers import gguf_quant_ops as ops
from radixengine.layers.gguf_quant_ops import GGML_Q4_1, GGML_Q8_0

gguf = pytest.importorskip("gguf")
QTYPES = (GGML_Q4_1, GGML_Q8_0)
needs_native = pytest.mark.skipif(not ops.quant_native_available(), reason="the native CPU kernels are not built")


def _blocks(rows: int, cols: int, qtype: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * scale
    return torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype)))


def _gguf_dequantize(q: torch.Tensor, qtype: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(q.numpy(), gguf.GGMLQuantizationType(qtype))))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("scale", [1e-6, 1e-2, 1.0, 300.0])
def test_dequantize_reference_is_bit_identical(qtype, scale):
    q = _blocks(13, 96, qtype, seed=int(scale * 7) % 5, scale=scale)
    assert torch.equal(ops.dequantize_reference(q, qtype), _gguf_dequantize(q, qtype))


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_reference_random_bytes(qtype):
    """Arbitrary block bytes: negative m, subnormal and large fp16 scales (no inf/nan)."""
    rng = np.random.default_rng(3)
    block = ops.BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, size=(64, 4 * block), dtype=np.uint8)
    blocks = raw.reshape(64, 4, block)
    scales = rng.standard_normal((64, 4, 2)).astype(np.float16)
    scales[:, 0, 0] = np.float16(3e-7)  # subnormal d
    scales[:, 1, 1] = -np.float16(1000.0)  # negative (Q4_1: m)
    nscales = 2 if qtype == GGML_Q4_1 else 1
    blocks[..., : 2 * nscales] = scales[..., :nscales].view(np.uint8).reshape(64, 4, 2 * nscales)
    q = torch.from_numpy(np.ascontiguousarray(blocks.reshape(64, -1)))
    assert torch.equal(ops.dequantize_reference(q, qtype), _gguf_dequantize(q, qtype))


@needs_native
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n,k", [(1, 32), (7, 576), (960, 576), (3072, 576), (576, 1536)])
def test_native_equals_reference(qtype, n, k):
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
            x = torch.randn(m, q.shape[1] // ops.BLOCK_BYTES[qtype] * ops.QK)
            got, ref = ops.quant_linear(x, q, qtype), ops.quant_linear_reference(x, q, qtype)
            assert (got - ref).abs().max().item() <= 1e-5 * (1 + ref.abs().max().item()), t.name


@pytest.mark.parametrize(
    "x, q, qtype, message",
    [
        (torch.randn(2, 64), torch.zeros(4, 40, dtype=torch.uint8), 2, "unsupported GGML quantization type"),
        (torch.randn(2, 64), torch.zeros(4, 40, dtype=torch.int8), GGML_Q4_1, "uint8"),
        (torch.randn(2, 64), torch.zeros(4, 41, dtype=torch.uint8), GGML_Q4_1, "whole number"),
        (torch.randn(2, 64).double(), torch.zeros(4, 40, dtype=torch.uint8), GGML_Q4_1, "float32"),
        (torch.randn(2, 48), torch.zeros(4, 40, dtype=torch.uint8), GGML_Q4_1, "multiple of the block size"),
        (torch.randn(2, 96), torch.zeros(4, 40, dtype=torch.uint8), GGML_Q4_1, "needs 60"),
    ],
)
def test_bad_inputs_raise(x, q, qtype, message):
    with pytest.raises(ValueError, match=message):
        ops.quant_linear(x, q, qtype)
