"""The Triton LoRA delta (the CUDA path of `apply_lora_delta`) against each row's `x A_s^T B_s` in
float64: fp32 and bf16, stacks of 1-3 modules, slots of different ranks and base rows
interleaved (a decode batch: one row a request) or in runs longer than a program's 16 rows (an
extend), and the pool's columns past a slot's rank never read. On a CPU under TRITON_INTERPRET=1
(tests/test_triton_interpreted.py runs it so)."""

from __future__ import annotations

import pytest
import torch
from triton_test_utils import DEVICE, on_gpu_or_interpreted

from radixengine.lora.lora_batch_info import LoRABatchInfo

pytest.importorskip("triton")
pytestmark = on_gpu_or_interpreted

BATCHES = {
    "decode": ([(i * 7) % 4 for i in range(21)], [1] * 21),
    "extend": ([1, 0, 3, 1, 2], [37, 5, 16, 3, 20]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pieces", [(37,), (14, 21), (40, 8, 8)], ids=["stack1", "stack2", "stack3"])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_triton_delta_equals_per_row_reference(batch, pieces, dtype):
    from radixengine.lora.lora_backend import triton_delta

    gen = torch.Generator().manual_seed(len(pieces))
    stack, fan_in, fan_out, max_rank = len(pieces), 70, sum(pieces), 7
    ranks = {1: 7, 2: 1, 3: 5}
    a = torch.randn(4, max_rank, stack, fan_in, generator=gen)
    b = torch.randn(4, max_rank, stack, fan_out, generator=gen)
    slots, tokens = BATCHES[batch]
    rows = sum(tokens)
    x = torch.randn(rows, fan_in, generator=gen)
    y = torch.randn(rows, fan_out, generator=gen)
    a, b, x, y = (t.to(dtype) for t in (a, b, x, y))
    expected = y.double()
    starts = torch.tensor((0, *pieces)).cumsum(0).tolist()
    row_slots = [s for s, n in zip(slots, tokens) for _ in range(n)]
    for row, slot in enumerate(row_slots):
        for k in range(stack) if slot else ():
            a_k, b_k = a[slot, : ranks[slot], k].double(), b[slot, : ranks[slot], k].double()
            cols = slice(starts[k], starts[k + 1])
            expected[row, cols] += (x[row].double() @ a_k.t()) @ b_k[:, cols]
    for slot in (2, 3):  # the pool's rows past a slot's rank are never read
        a[slot, ranks[slot] :] = float("nan")
        b[slot, ranks[slot] :] = float("nan")
    info = LoRABatchInfo.build(slots, tokens, ranks, torch.device(DEVICE))
    got = y.clone().to(DEVICE)
    triton_delta(x.to(DEVICE), got, a.to(DEVICE), b.to(DEVICE), info, pieces)
    # bf16: the inputs' products in fp32, h rounded to bf16 once, the output once.
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 0.02, "atol": 0.15}
    torch.testing.assert_close(got.cpu().double(), expected, check_dtype=False, **tol)
    base = [i for i, s in enumerate(row_slots) if s == 0]
    assert torch.equal(got.cpu()[base], y[base])


def test_a_captured_graphs_static_tables_give_the_batchs_delta():
    """Under a CUDA graph the kernels read static tables (lora/lora_graph.py): filled from a
    batch of 5 decode rows for the graph of 8, they give the batch's own delta and leave the
    padded rows alone; refilled from a smaller batch, the entries of the one before are gone."""
    from radixengine.lora.lora_backend import triton_delta
    from radixengine.lora.lora_graph import LoRAGraphBuffers

    gen = torch.Generator().manual_seed(5)
    pieces, fan_in, max_rank = (24, 8), 40, 4
    a = torch.randn(4, max_rank, 2, fan_in, generator=gen).to(DEVICE)
    b = torch.randn(4, max_rank, 2, sum(pieces), generator=gen).to(DEVICE)
    x = torch.randn(8, fan_in, generator=gen).to(DEVICE)
    y = torch.randn(8, sum(pieces), generator=gen).to(DEVICE)
    graph = LoRAGraphBuffers(8, 3, torch.device(DEVICE))
    for slots in ([1, 0, 3, 3, 2], [0, 2]):
        bs = len(slots)
        batch = LoRABatchInfo.build(slots, [1] * bs, {1: 4, 2: 1, 3: 3}, torch.device(DEVICE))
        expected = y.clone()
        triton_delta(x[:bs], expected[:bs], a, b, batch, pieces)
        graph.fill(batch, 8)
        got = y.clone()
        triton_delta(x, got, a, b, graph.captured_info(8), pieces)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
        assert torch.equal(got[bs:], y[bs:]) and not torch.equal(got[:bs], y[:bs])
