"""The kernels one decode step launches on the CUDA path (the Triton backend and the fused Triton
ops), counted on a CPU under TRITON_INTERPRET=1: every Triton launch, and every aten op that
would launch a device kernel (views, allocations and shape ops do not). The count per layer is
what sets a decode step's floor on a GPU, where each launch costs microseconds.

Runs in a child pytest under the interpreter (tests/test_triton_interpreted.py).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from model_utils import ModelDriver, make_runner, save_tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from radixengine.layers.native_small_ops import native_small_ops

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="on a CPU under TRITON_INTERPRET=1 only (tests/test_triton_interpreted.py runs it so)",
)

aten = torch.ops.aten
# Ops that make no device kernel: views, metadata, allocations (the caching allocator).
_NO_KERNEL = {
    aten.view, aten._unsafe_view, aten.reshape, aten.t, aten.transpose, aten.permute, aten.expand,
    aten.slice, aten.select, aten.unsqueeze, aten.squeeze, aten.as_strided, aten.alias, aten.detach,
    aten.split, aten.split_with_sizes, aten.unbind, aten.chunk, aten.narrow, aten.empty, aten.empty_like,
    aten.empty_strided, aten.new_empty, aten.new_empty_strided, aten.lift_fresh, aten.sym_size,
    aten.sym_stride, aten.sym_numel, aten.sym_storage_offset, aten.is_same_size, aten._reshape_alias,
    aten.view_as_real, aten.view_as_complex, aten._local_scalar_dense, aten.dim, aten.unflatten,
    aten.flatten,
}  # fmt: skip


class LaunchCounter(TorchDispatchMode):
    """aten ops that launch a kernel, by name; Triton launches are added by `count_triton`."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and func.overloadpacket not in _NO_KERNEL:
            self.ops[f"aten.{func.overloadpacket.__name__}"] += 1
        return func(*args, **(kwargs or {}))


def count_triton(counter: LaunchCounter, monkeypatch) -> None:
    """Count each interpreted Triton launch once, not the torch ops the interpreter runs."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        counter.ops[f"triton.{self.fn.__name__}"] += 1
        counter.paused += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            counter.paused -= 1

    monkeypatch.setattr(InterpretedFunction, "run", counted)


def test_decode_step_kernels_per_layer(tmp_path, monkeypatch):
    """Counts a decode step of a 2-layer Llama on the Triton path; the per-layer count is the
    step's count less a 1-layer model's (embedding, final norm, LM head and the step's setup
    are the same in both)."""
    counts = {}
    for layers in (1, 2):
        folder = tmp_path / f"l{layers}"
        save_tiny_model("llama", folder, num_hidden_layers=layers)
        runner = make_runner(folder, attention_backend="triton")
        driver = ModelDriver(runner)
        driver.extend({"a": [1, 2, 3, 4, 5], "b": [6, 7, 8]})
        counter = LaunchCounter()
        count_triton(counter, monkeypatch)
        with native_small_ops(False), counter:  # the torch small ops, as on CUDA
            driver.decode({"a": 9, "b": 10})
        monkeypatch.undo()
        counts[layers] = counter.ops
    per_layer = counts[2] - counts[1]
    total = sum(per_layer.values())
    print(f"kernels per layer: {total}: {dict(per_layer)}")
    # A layer: RMSNorm + residual (fused), q/k/v GEMM, rotary (in place) with the K/V write,
    # decode attention (two stages), o GEMM, RMSNorm + residual, gate/up GEMM, SiLU-and-mul,
    # down GEMM.
    assert per_layer == Counter(
        {
            "triton._rmsnorm_kernel": 2,
            "aten.mm": 4,
            "triton._rope_store_kv_kernel": 1,
            "triton._decode_stage1": 1,
            "triton._decode_stage2": 1,
            "triton._silu_and_mul_kernel": 1,
        }
    )
    # 10 (18 with the torch rotary and K/V write); the target is 8. A batch that fills the GPU
    # alone runs one decode stage (this batch of 2 splits each request's KV: two stages).
    assert total == 10


def test_decode_splits_come_from_the_batch_size():
    from radixengine.layers.triton_ops.decode_attention import decode_num_splits

    assert decode_num_splits(1, 3, 132) == 16  # a small batch: the most splits
    assert decode_num_splits(8, 3, 132) == 16
    assert decode_num_splits(64, 3, 132) == 2
    assert decode_num_splits(88, 3, 132) == 1  # 264 programs: two per SM without splitting
    assert decode_num_splits(512, 8, 132) == 1
    assert decode_num_splits(1, 1, 132, max_splits=4) == 4


@pytest.mark.parametrize("window_left,logit_cap", [(-1, 0.0), (5, 3.0)])
def test_one_split_writes_the_output_in_stage_one(window_left, logit_cap, monkeypatch):
    """With one split stage 1 writes the output itself (stage 2 is not launched), equal to the
    split kernel's and the reference's."""
    from radixengine.layers.attention.native_cpu_ops import decode_attention_reference
    from radixengine.layers.triton_ops import decode_attention as module

    torch.manual_seed(3)
    lens = [1, 7, 40]
    k_buf, v_buf = torch.randn(60, 2, 32), torch.randn(60, 2, 32)
    req_to_token = torch.zeros(3, 44, dtype=torch.int32)
    slots = torch.randperm(59) + 1
    start = 0
    for row, n in enumerate(lens):
        req_to_token[row, :n] = slots[start : start + n].int()
        start += n
    args = (torch.randn(3, 6, 32), k_buf, v_buf, req_to_token, torch.arange(3), torch.tensor(lens), 0.2)
    launched = []
    stage2 = module._decode_stage2

    class Counting:
        def __getitem__(self, grid):
            launched.append(grid)
            return stage2[grid]

    monkeypatch.setattr(module, "_decode_stage2", Counting())
    one = module.decode_attention(*args, num_splits=1, window_left=window_left, logit_cap=logit_cap)
    assert not launched
    split = module.decode_attention(*args, num_splits=4, window_left=window_left, logit_cap=logit_cap)
    assert len(launched) == 1
    ref = decode_attention_reference(*args, window_left=window_left, logit_cap=logit_cap)
    torch.testing.assert_close(one, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(split, ref, atol=1e-4, rtol=1e-4)
