"""The Triton extend attention kernel (one launch per layer for a whole extend batch over the
paged pool) against torch_native's per-request SDPA, its reference: random data, ragged
lengths, cached prefixes that end inside a page, GQA, page sizes 1 and > 1, sliding windows and
soft-capping. On a CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, which Triton
reads when it is imported: tests/test_triton_interpreted.py runs this module in a child process
with it), so the shapes are small.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from triton_test_utils import DEVICE, on_gpu_or_interpreted

from radixengine.layers.attention.torch_native_backend import TorchNativeAttnBackend
from radixengine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from radixengine.model_executor.forward_batch_info import ForwardMode

pytest.importorskip("triton")
pytestmark = on_gpu_or_interpreted


@pytest.fixture(scope="module")
def triton_backend_cls():
    from radixengine.layers.attention.triton_backend import TritonAttnBackend

    return TritonAttnBackend


@dataclass
class Layer:
    layer_id: int
    tp_q_head_num: int
    tp_k_head_num: int
    tp_v_head_num: int
    qk_head_dim: int
    v_head_dim: int
    scaling: float
    logit_cap: float = 0.0
    sliding_window_size: int = -1


@dataclass
class Batch:
    """The fields of a ForwardBatch that attention reads."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: list[int]
    out_cache_loc: torch.Tensor
    extend_seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool


def make_batch(
    rng: random.Random,
    prefixes: list[int],
    news: list[int],
    num_kv: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
) -> Batch:
    """Requests on scattered pages of a pool whose prefixes' K/V are random; the new tokens'
    slots continue each prefix's last page, then take free pages."""
    bs = len(prefixes)
    pages_per_req = [-(-(p + n) // page_size) for p, n in zip(prefixes, news)]
    num_pages = sum(pages_per_req) + 3
    pool = MHATokenToKVPool(num_pages * page_size, page_size, dtype, num_kv, head_dim, 1, DEVICE)
    k_buf, v_buf = pool.get_kv_buffer(0)
    k_buf.copy_(torch.randn(k_buf.shape, dtype=torch.float32).to(dtype))
    v_buf.copy_(torch.randn(v_buf.shape, dtype=torch.float32).to(dtype))
    req_pool = ReqToTokenPool(bs + 2, max(p + n for p, n in zip(prefixes, news)) + 1, DEVICE)
    free_pages = list(range(1, num_pages + 1))
    rng.shuffle(free_pages)
    rows = rng.sample(range(bs + 2), bs)
    new_locs = []
    for row, prefix, num_new, n_pages in zip(rows, prefixes, news, pages_per_req):
        pages = [free_pages.pop() for _ in range(n_pages)]
        slots = [pages[i // page_size] * page_size + i % page_size for i in range(prefix + num_new)]
        req_pool.write((row, slice(0, len(slots))), torch.tensor(slots, dtype=torch.int32))
        new_locs += slots[prefix:]
    total = sum(news)
    return Batch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=bs,
        input_ids=torch.zeros(total, dtype=torch.int64, device=DEVICE),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=DEVICE),
        seq_lens=torch.tensor([p + n for p, n in zip(prefixes, news)], device=DEVICE),
        seq_lens_cpu=[p + n for p, n in zip(prefixes, news)],
        out_cache_loc=torch.tensor(new_locs, dtype=torch.int64, device=DEVICE),
        extend_seq_lens_cpu=list(news),
        extend_prefix_lens_cpu=list(prefixes),
        req_to_token_pool=req_pool,
        token_to_kv_pool=pool,
    )


def run_both(
    backend_cls, batch: Batch, layer: Layer, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    total = sum(batch.extend_seq_lens_cpu)
    q = torch.randn(total, layer.tp_q_head_num * layer.qk_head_dim, device=DEVICE).to(dtype)
    k = torch.randn(total, layer.tp_k_head_num * layer.qk_head_dim, device=DEVICE).to(dtype)
    v = torch.randn(total, layer.tp_v_head_num * layer.v_head_dim, device=DEVICE).to(dtype)
    outs = []
    for cls in (TorchNativeAttnBackend, backend_cls):
        backend = cls()
        backend.init_forward_metadata(batch)
        outs.append(backend.forward(q, k, v, layer, batch).float())
    return outs[0], outs[1]


CASES = [
    # prefixes, new tokens, (q heads, kv heads, head dim), page size, window, cap
    ([0], [1], (2, 1, 16), 1, -1, 0.0),
    ([0, 5, 17], [9, 1, 20], (4, 2, 16), 1, -1, 0.0),
    ([3, 0, 30, 7], [18, 33, 2, 16], (4, 1, 32), 4, -1, 0.0),  # prefixes end inside pages
    ([13, 6], [21, 40], (6, 3, 24), 16, -1, 0.0),  # head dim not a power of two
    ([0, 25, 9], [35, 12, 19], (4, 2, 16), 4, 7, 0.0),  # sliding window
    ([0, 20], [30, 3], (2, 2, 16), 1, 0, 0.0),  # a window of the token itself
    ([11, 0, 4], [17, 26, 1], (4, 2, 16), 8, -1, 5.0),  # soft-capping
    ([18, 2], [23, 9], (8, 2, 16), 4, 5, 3.0),  # both
]


@pytest.mark.parametrize("prefixes,news,heads,page_size,window,cap", CASES)
def test_extend_kernel_matches_torch_native(
    triton_backend_cls, prefixes, news, heads, page_size, window, cap
):
    rng = random.Random(len(prefixes) * 100 + sum(news))
    torch.manual_seed(sum(prefixes) + page_size)
    num_q, num_kv, head_dim = heads
    batch = make_batch(rng, prefixes, news, num_kv, head_dim, page_size, torch.float32)
    layer = Layer(0, num_q, num_kv, num_kv, head_dim, head_dim, head_dim**-0.5, cap, window)
    ref, got = run_both(triton_backend_cls, batch, layer, torch.float32)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)


def test_extend_kernel_bf16_and_random_ragged_batches(triton_backend_cls):
    rng = random.Random(7)
    for trial in range(3):
        torch.manual_seed(trial)
        bs = rng.randint(1, 4)
        prefixes = [rng.choice([0, rng.randint(1, 40)]) for _ in range(bs)]
        news = [rng.randint(1, 36) for _ in range(bs)]
        page_size = rng.choice([1, 2, 8])
        window = rng.choice([-1, -1, rng.randint(0, 20)])
        batch = make_batch(rng, prefixes, news, 2, 16, page_size, torch.bfloat16)
        layer = Layer(0, 4, 2, 2, 16, 16, 0.25, rng.choice([0.0, 4.0]), window)
        ref, got = run_both(triton_backend_cls, batch, layer, torch.bfloat16)
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


def test_one_launch_per_layer_for_the_whole_batch(triton_backend_cls, monkeypatch):
    """The backend calls the kernel once per layer whatever the batch size (the per-request
    SDPA loop is the reference only)."""
    from radixengine.layers.triton_ops import extend_attention as module

    calls = []
    kernel = module._extend_attention

    class Counting:
        def __getitem__(self, grid):
            calls.append(grid)
            return kernel[grid]

    monkeypatch.setattr(module, "_extend_attention", Counting())
    rng = random.Random(3)
    batch = make_batch(rng, [0, 4, 9, 2, 0], [5, 3, 12, 1, 7], 2, 16, 4, torch.float32)
    layer = Layer(0, 4, 2, 2, 16, 16, 0.25)
    ref, got = run_both(triton_backend_cls, batch, layer, torch.float32)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
    assert len(calls) == 1 and calls[0][0] == 5
