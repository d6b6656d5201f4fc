"""bf16-stored linears in fp32 arithmetic (layers/bf16_linear.py, csrc/cpu_bf16_linear.cpp) and the
choice of the CPU linears' kernel and compute dtype (layers/cpu_linear_plan.py, utils/cpu_bf16.py):
the packed layout, the kernel against its pure-torch reference on every ISA level this CPU runs,
a model on the panels against transformers (greedy tokens) and against torch's linears, and the
choice and its reason as the worker reports them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_utils import ModelDriver, assert_runners_agree, make_runner, save_tiny_model

from radixengine.layers.attention import native_cpu_ops
from radixengine.layers.bf16_linear import (
    Bf16PanelWeight,
    bf16_linear_reference,
    bf16_pack_linear_weight_reference,
    holds_bf16_values,
    unpack_bf16_linear_weight,
)
from radixengine.layers.cpu_linear_plan import bf16_panels_unavailable_reason, plan_cpu_linears
from radixengine.model_loader import weight_utils
from radixengine.utils import cpu_isa
from radixengine.utils.cpu_bf16 import bf16_matmul_support

needs_panels = pytest.mark.skipif(
    bf16_panels_unavailable_reason() is not None, reason=f"bf16 panels: {bf16_panels_unavailable_reason()}"
)
ZEN4_FLAGS = cpu_isa.REQUIRED_CPU_FLAGS["avx512"] | {"avx512_bf16"}
AVX2_FLAGS = cpu_isa.REQUIRED_CPU_FLAGS["avx2"]


def _rand(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def test_reference_layout_puts_each_weight_in_its_panel():
    w = torch.arange(64 * 40, dtype=torch.float32).view(64, 40).to(torch.bfloat16)
    packed = bf16_pack_linear_weight_reference(w)
    assert packed.shape == (2, 40, 32)
    for n, k in [(0, 0), (17, 5), (33, 39), (63, 20)]:
        assert packed[n // 32, k, n % 32] == w[n, k]
    assert torch.equal(unpack_bf16_linear_weight(packed), w)


def test_reference_is_a_float32_matmul_rounded_once():
    w, b = _rand(96, 64, dtype=torch.bfloat16), _rand(96, seed=2, dtype=torch.bfloat16)
    for x in (_rand(5, 64, seed=1), _rand(5, 64, seed=1, dtype=torch.bfloat16)):
        got = bf16_linear_reference(x, bf16_pack_linear_weight_reference(w), b)
        assert got.dtype == x.dtype
        assert torch.equal(got, (x.float() @ w.float().T + b.float()).to(x.dtype))


def test_holds_bf16_values():
    w = _rand(8, 8)
    assert not holds_bf16_values(w)
    assert holds_bf16_values(w.to(torch.bfloat16).float())
    assert holds_bf16_values(w.to(torch.bfloat16))
    assert not holds_bf16_values(w.to(torch.bfloat16).half())


def check_native_bf16_linear() -> None:
    """The packing and the product on this process's native level: every row count around the
    decode / prefill switch (24) and the row blocks (96), fp32 and bf16 activations, with and
    without a bias, against the reference."""
    native = native_cpu_ops.require_native()
    for n, k in [(32, 1), (96, 40), (192, 576)]:
        w = _rand(n, k, seed=n + k, dtype=torch.bfloat16)
        assert torch.equal(native.bf16_pack_linear_weight(w), bf16_pack_linear_weight_reference(w))
        weight = Bf16PanelWeight.pack(w)
        for rows in (0, 1, 5, 24, 25, 96, 97, 200):
            for dtype in (torch.float32, torch.bfloat16):
                x = _rand(rows, k, seed=rows, dtype=dtype)
                for bias in (None, _rand(n, seed=3, dtype=dtype)):
                    got = weight.linear(x, bias)
                    want = bf16_linear_reference(x, weight.packed, bias)
                    assert got.dtype == dtype and got.shape == (rows, n)
                    if dtype == torch.float32:  # other summation orders only
                        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k**0.5)
                    else:  # at most one bf16 rounding step apart
                        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-2)


def check_greedy_matches_transformers(folder: str) -> None:
    """A float32 model whose weights hold bf16 values runs its linears on the panels (native
    attention) and its greedy tokens are transformers' float32 ones."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    runner = make_runner(folder, attention_backend="native_cpu")
    assert runner.linear_kernel == "bf16_panels" and runner.bf16_panel_linears > 0
    driver = ModelDriver(runner)
    prompts = {"a": [5, 17, 3, 99, 42, 7, 8, 120, 33, 2, 64, 1], "b": [9, 4, 250]}
    ours = {rid: [] for rid in prompts}
    next_ids = driver.extend(prompts).argmax(-1).tolist()
    for _ in range(24):
        for rid, tok in zip(prompts, next_ids):
            ours[rid].append(tok)
        next_ids = driver.decode(dict(zip(prompts, next_ids))).argmax(-1).tolist()
    for rid, tokens in prompts.items():
        ids = torch.tensor([tokens])
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, pad_token_id=0
        )
        assert ours[rid] == out[0, len(tokens) :].tolist(), rid


def save_bf16_valued_model(folder: Path, **overrides) -> None:
    """A tiny llama whose weights are all bf16 values (a 16-bit checkpoint), saved in float32."""
    model = save_tiny_model("llama", folder, **overrides)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(folder)


@needs_panels
def test_native_kernel_equals_the_reference():
    check_native_bf16_linear()


@needs_panels
@pytest.mark.parametrize("level", cpu_isa.supported_levels())
def test_kernel_and_greedy_tokens_on_every_isa_level(level, tmp_path):
    """The kernel checks and the greedy tokens against transformers in a fresh interpreter for
    each level this CPU runs (RADIXENGINE_CPU_ISA)."""
    save_bf16_valued_model(tmp_path)
    tests_dir = Path(__file__).resolve().parent
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(tests_dir)!r})\n"
        "from radixengine.layers.attention import native_cpu_ops\n"
        "import test_bf16_linear as t\n"
        "t.check_native_bf16_linear()\n"
        f"t.check_greedy_matches_transformers({str(tmp_path)!r})\n"
        "print(native_cpu_ops.native_level())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RADIXENGINE_JIT_BUILD"}
    env[cpu_isa.ENV_VAR] = level
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1] == level


@needs_panels
def test_kernel_result_does_not_depend_on_thread_count():
    weight = Bf16PanelWeight.pack(_rand(320, 96, dtype=torch.bfloat16))
    threads = torch.get_num_threads()
    for rows in (3, 150):
        x = _rand(rows, 96, seed=rows)
        try:
            torch.set_num_threads(1)
            one = weight.linear(x)
            torch.set_num_threads(2)
            two = weight.linear(x)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, two)


@needs_panels
def test_kernel_refuses_what_it_cannot_take():
    native = native_cpu_ops.require_native()
    with pytest.raises(RuntimeError, match="multiple of 32"):
        native.bf16_pack_linear_weight(_rand(40, 64, dtype=torch.bfloat16))
    packed = native.bf16_pack_linear_weight(_rand(32, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="features"):
        native.bf16_linear(_rand(4, 32), packed)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        native.bf16_linear(_rand(4, 64, dtype=torch.float16), packed)


def test_bf16_matmul_support_follows_the_cpu_and_the_caps():
    assert bf16_matmul_support(ZEN4_FLAGS, {}).native
    assert "AVX512-BF16" in bf16_matmul_support(ZEN4_FLAGS, {}).reason
    no_bf16 = bf16_matmul_support(ZEN4_FLAGS - {"avx512_bf16"}, {})
    assert not no_bf16.native and "no AMX-BF16 or AVX512-BF16" in no_bf16.reason
    assert not bf16_matmul_support(AVX2_FLAGS, {}).native
    forced = bf16_matmul_support(ZEN4_FLAGS, {cpu_isa.ENV_VAR: "avx2"})
    assert not forced.native and "RADIXENGINE_CPU_ISA=avx2" in forced.reason
    capped = bf16_matmul_support(ZEN4_FLAGS, {"ONEDNN_MAX_CPU_ISA": "avx2"})
    assert not capped.native and "ONEDNN_MAX_CPU_ISA=AVX2" in capped.reason
    assert bf16_matmul_support(ZEN4_FLAGS, {"ONEDNN_MAX_CPU_ISA": "ALL"}).native


def test_auto_dtype_names_its_reason(monkeypatch):
    monkeypatch.setattr(weight_utils, "bf16_matmul_support", lambda: bf16_matmul_support(AVX2_FLAGS, {}))
    dtype, reason = weight_utils.resolve_dtype_with_reason("auto", "cpu")
    assert dtype == torch.float32 and "no AMX-BF16 or AVX512-BF16" in reason
    monkeypatch.setattr(weight_utils, "bf16_matmul_support", lambda: bf16_matmul_support(ZEN4_FLAGS, {}))
    dtype, reason = weight_utils.resolve_dtype_with_reason("auto", "cpu")
    assert dtype == torch.bfloat16 and "AVX512-BF16" in reason
    assert weight_utils.resolve_dtype_with_reason("bfloat16", "cpu") == (torch.bfloat16, "--dtype bfloat16")


@needs_panels
def test_plan_per_dtype_and_cpu(monkeypatch):
    monkeypatch.setenv("RADIXENGINE_AMX_LINEAR", "0")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # this CPU as an AVX2 CPU sees it
    assert plan_cpu_linears(torch.bfloat16).kernel == "bf16_panels"
    assert plan_cpu_linears(torch.float32).kernel == "bf16_panels"
    assert plan_cpu_linears(torch.float16).kernel == "torch"
    monkeypatch.setenv("RADIXENGINE_BF16_PANELS", "0")
    plan = plan_cpu_linears(torch.bfloat16)
    assert plan.kernel == "torch" and "RADIXENGINE_BF16_PANELS=0" in plan.reason


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_bf16_values")
    save_bf16_valued_model(path, tie_word_embeddings=True)
    return path


@needs_panels
def test_bf16_model_on_panels_matches_torch_linears(bf16_folder, monkeypatch):
    """A bf16 model on a CPU without native bf16 products (here: oneDNN capped to AVX2) runs its
    linears and LM head on the panels; logits as torch's bf16 linears give them."""
    monkeypatch.setenv("RADIXENGINE_AMX_LINEAR", "0")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    runner = make_runner(bf16_folder, dtype="bfloat16", attention_backend="native_cpu")
    assert runner.linear_kernel == "bf16_panels" and runner.bf16_panel_linears > 0
    assert runner.model.lm_head.amx_weight is not None
    assert runner.model.model.embed_tokens.weight is not None  # tied: the embedding keeps it
    monkeypatch.setenv("RADIXENGINE_BF16_PANELS", "0")
    plain = make_runner(bf16_folder, dtype="bfloat16", attention_backend="native_cpu")
    assert plain.linear_kernel == "torch" and plain.bf16_panel_linears == 0
    assert_runners_agree(runner, plain)


@needs_panels
def test_worker_info_names_the_choice_and_why(bf16_folder, tmp_path):
    from radixengine.model_executor.tp_worker import TpModelWorker

    info = TpModelWorker(make_runner(bf16_folder).server_args).get_worker_info()
    assert info.linear_kernel == "bf16_panels" and info.bf16_panel_linear_layers > 0
    assert "bf16 values" in info.linear_kernel_reason
    assert (info.resolved_dtype, info.resolved_dtype_reason) == ("float32", "--dtype float32")
    assert info.resolved_kv_cache_dtype == "float32"
    save_tiny_model("llama", tmp_path)  # random float32 weights: nothing holds bf16 values
    info = TpModelWorker(make_runner(tmp_path).server_args).get_worker_info()
    assert info.linear_kernel == "torch" and info.bf16_panel_linear_layers == 0
    assert info.linear_kernel_reason == "no linear weight holds only bf16 values"
