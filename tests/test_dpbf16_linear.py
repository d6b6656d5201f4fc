"""bf16 linears on AVX512-BF16 dot products (layers/dpbf16_linear.py,
csrc/cpu_dpbf16_linear.cpp): the kernel against its pure-torch reference and F.linear for every
register tile's row count, and a model whose linears run on it against the same model on
oneDNN. The kernel tests skip where the CPU has no AVX512-BF16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixengine.layers.amx_linear import amx_linear_reference
from radixengine.layers.attention import native_cpu_ops
from radixengine.layers.cpu_linear_plan import plan_cpu_linears
from radixengine.layers.dpbf16_linear import DpBf16Weight, dpbf16_linear_unavailable_reason
from tests.model_utils import assert_runners_agree, make_runner, save_tiny_model

needs_dpbf16 = pytest.mark.skipif(
    dpbf16_linear_unavailable_reason() is not None,
    reason=f"AVX512-BF16 linears: {dpbf16_linear_unavailable_reason()}",
)


def _bf16(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


@needs_dpbf16
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 31, 33, 127, 128, 129, 300])
@pytest.mark.parametrize("shape", [(32, 32), (96, 64), (576, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_equals_the_reference(rows, shape, with_bias):
    n, k = shape
    w, x = _bf16(n, k, seed=rows), _bf16(rows, k, seed=rows + 1)
    bias = _bf16(n, seed=3) if with_bias else None
    weight = DpBf16Weight.pack(w)
    got = weight.linear(x, bias).float()
    want = amx_linear_reference(x, weight.packed, bias).float()
    # Both sum in float32, in other orders: at most one bf16 rounding step apart.
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(got, F.linear(x, w, bias).float(), rtol=2**-7, atol=1e-2)


@needs_dpbf16
def test_kernel_result_does_not_depend_on_thread_count():
    w, x = _bf16(576, 1536), _bf16(40, 1536, seed=1)
    weight = DpBf16Weight.pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = weight.linear(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, weight.linear(x))


@needs_dpbf16
def test_kernel_keeps_leading_dims_and_nan_stays_in_its_row():
    w = _bf16(64, 64)
    x = _bf16(2, 3, 64, seed=4)
    x[1, 2, 7] = float("nan")
    y = DpBf16Weight.pack(w).linear(x)
    assert y.shape == (2, 3, 64)
    assert torch.isnan(y[1, 2]).all()
    assert not torch.isnan(y.view(6, 64)[:5]).any()


@needs_dpbf16
def test_kernel_refuses_what_it_cannot_take():
    native = native_cpu_ops.require_native()
    packed = native.amx_pack_linear_weight(_bf16(32, 64))
    with pytest.raises(RuntimeError, match="K = 32"):
        native.dpbf16_linear(_bf16(4, 32), packed)
    with pytest.raises(RuntimeError, match="bfloat16"):
        native.dpbf16_linear(torch.randn(4, 64), packed)


def test_switch_off_names_itself_and_leaves_bf16_linears_to_onednn(monkeypatch):
    monkeypatch.setenv("RADIXENGINE_DPBF16_LINEAR", "0")
    assert dpbf16_linear_unavailable_reason() == "RADIXENGINE_DPBF16_LINEAR=0"
    monkeypatch.setenv("RADIXENGINE_AMX_LINEAR", "0")
    plan = plan_cpu_linears(torch.bfloat16)
    assert plan.kernel != "dpbf16"
    if plan.kernel == "torch" and "oneDNN" in plan.reason:
        assert "RADIXENGINE_DPBF16_LINEAR=0" in plan.reason


@needs_dpbf16
def test_plan_takes_the_dot_products_where_there_is_no_amx(monkeypatch):
    monkeypatch.setenv("RADIXENGINE_AMX_LINEAR", "0")
    plan = plan_cpu_linears(torch.bfloat16)
    assert plan.kernel == "dpbf16" and "AVX512-BF16" in plan.reason
    assert plan_cpu_linears(torch.float32).kernel != "dpbf16"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # this CPU as an AVX2 CPU sees it
    assert plan_cpu_linears(torch.bfloat16).kernel == "bf16_panels"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_dpbf16")
    save_tiny_model("llama", path, tie_word_embeddings=True)
    return path


@needs_dpbf16
def test_model_on_dpbf16_linears_matches_onednn(folder, monkeypatch):
    monkeypatch.setenv("RADIXENGINE_AMX_LINEAR", "0")
    runner = make_runner(folder, dtype="bfloat16", attention_backend="native_cpu")
    assert runner.linear_kernel == "dpbf16" and runner.dpbf16_linears > 0
    linears = [m for m in runner.model.modules() if getattr(m, "amx_weight", None) is not None]
    assert all(isinstance(m.amx_weight, DpBf16Weight) for m in linears)
    assert all(m.weight is None for m in linears if not m.keeps_float_weight())
    assert runner.model.lm_head.weight is not None  # tied: the embedding keeps its table
    monkeypatch.setenv("RADIXENGINE_DPBF16_LINEAR", "0")
    plain = make_runner(folder, dtype="bfloat16", attention_backend="native_cpu")
    assert plain.dpbf16_linears == 0
    assert_runners_agree(runner, plain)


@needs_dpbf16
def test_worker_info_reports_the_packed_linears(folder, monkeypatch):
    from radixengine.model_executor.tp_worker import TpModelWorker

    monkeypatch.setenv("RADIXENGINE_AMX_LINEAR", "0")
    info = TpModelWorker(make_runner(folder, dtype="bfloat16").server_args).get_worker_info()
    assert info.linear_kernel == "dpbf16" and info.dpbf16_linear_layers > 0
    assert "vdpbf16ps" in info.linear_kernel_reason
