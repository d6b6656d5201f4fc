from __future__ import annotations

import random

import pytest
import torch

from radixengine.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator


def _token_allocator(size: int = 8, **kwargs) -> TokenToKVPoolAllocator:
    return TokenToKVPoolAllocator(size, torch.float16, "cpu", None, **kwargs)


def _paged_allocator(size: int, page_size: int, **kwargs) -> PagedTokenToKVPoolAllocator:
    return PagedTokenToKVPoolAllocator(size, page_size, torch.float16, "cpu", None, **kwargs)


def test_alloc_never_hands_out_slot_zero_and_exhausts_cleanly():
    alloc = _token_allocator(8)
    first = alloc.alloc(5)
    assert first.dtype == torch.int64 and first.tolist() == [1, 2, 3, 4, 5]
    state = alloc.backup_state()
    assert alloc.alloc(4) is None
    assert alloc.available_size() == 3
    assert all(torch.equal(a, b) for a, b in zip(state, alloc.backup_state()))
    assert alloc.alloc(3).tolist() == [6, 7, 8]
    assert alloc.alloc(1) is None and alloc.available_size() == 0
    assert alloc.alloc(0).numel() == 0

    alloc.free(first)
    assert alloc.available_size() == 5
    alloc.clear()
    assert alloc.available_size() == 8


def test_double_free_slot_zero_and_out_of_range_are_caught():
    alloc = _token_allocator(8)
    slots = alloc.alloc(4)
    alloc.free(slots[:2])
    with pytest.raises(ValueError, match="double free"):
        alloc.free(slots[1:3])
    with pytest.raises(ValueError, match="padding slot"):
        alloc.free(torch.tensor([0]))
    with pytest.raises(ValueError, match="outside"):
        alloc.free(torch.tensor([9]))
    with pytest.raises(ValueError, match="twice"):
        alloc.free(torch.tensor([3, 3]))
    assert alloc.available_size() == 6  # the failed frees changed nothing
    alloc.free(slots[2:])
    assert alloc.available_size() == 8


def test_bad_sizes_raise():
    with pytest.raises(ValueError):
        _token_allocator(0)
    with pytest.raises(ValueError):
        _paged_allocator(10, 4)  # not a whole number of pages
    alloc = _paged_allocator(16, 4)
    with pytest.raises(ValueError):
        alloc.alloc(-4)
    with pytest.raises(ValueError, match="multiple"):
        alloc.alloc(3)
    with pytest.raises(ValueError):
        _token_allocator(8).alloc(1.5)


def test_free_group_batches_frees_and_still_checks():
    alloc = _token_allocator(8)
    slots = alloc.alloc(6)
    alloc.free_group_begin()
    alloc.free(slots[:2])
    alloc.free(slots[2:3])
    assert alloc.available_size() == 2
    alloc.free_group_end()
    assert alloc.available_size() == 5

    alloc.free_group_begin()
    alloc.free(slots[3:4])
    alloc.free(slots[3:4])
    with pytest.raises(ValueError, match="twice"):
        alloc.free_group_end()


def test_need_sort_merges_released_slots_in_order():
    alloc = _token_allocator(6, need_sort=True)
    slots = alloc.alloc(6)
    alloc.free(slots[[4, 1, 3]])
    assert alloc.available_size() == 3
    assert alloc.alloc(2).tolist() == [2, 4]
    assert alloc.alloc(1).tolist() == [5]


def test_paged_alloc_and_free_by_page():
    alloc = _paged_allocator(16, 4)
    slots = alloc.alloc(8)
    assert slots.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert alloc.available_size() == 8
    alloc.free(slots[5:7])  # part of page 2 frees page 2
    assert alloc.available_size() == 12
    with pytest.raises(ValueError, match="double free"):
        alloc.free(torch.tensor([10]))
    with pytest.raises(ValueError, match="padding"):
        alloc.free(torch.tensor([3]))
    assert alloc.alloc(16) is None
    assert alloc.available_size() == 12
    assert alloc.alloc(4).tolist() == [8, 9, 10, 11]  # freed pages go to the front


def _expected_extend(pre: int, seq: int, last: int, ps: int, pages: list[int]) -> list[int]:
    """Slot of each token pre..seq-1, written token by token."""
    out, loc = [], last
    for pos in range(pre, seq):
        if pos % ps == 0:
            loc = pages.pop(0) * ps
        else:
            loc += 1
        out.append(loc)
    return out


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_alloc_extend_and_decode_continue_the_last_partial_page(page_size):
    rng = random.Random(page_size)
    alloc = _paged_allocator(page_size * 64, page_size)
    rows: list[list[int]] = []
    # First extend from nothing, then extend again over an unaligned prefix, then decode.
    for step in range(3):
        bs = 5
        if step == 0:
            pre = [0] * bs
            rows = [[] for _ in range(bs)]
        else:
            pre = [len(r) for r in rows]
        seq = [p + rng.randint(0, 2 * page_size + 1) for p in pre]
        last = [r[-1] if r else -1 for r in rows]
        free_before = alloc.free_pages.tolist()
        out = alloc.alloc_extend(pre, seq, last, sum(seq) - sum(pre))
        expected, pages = [], list(free_before)
        for i in range(bs):
            new = _expected_extend(pre[i], seq[i], last[i], page_size, pages)
            expected += new
            rows[i] += new
        assert out.tolist() == expected
        assert alloc.available_size() == len(pages) * page_size

    for _ in range(2 * page_size + 1):
        seq = [len(r) + 1 for r in rows]
        pages = alloc.free_pages.tolist()
        out = alloc.alloc_decode(seq, [r[-1] if r else -1 for r in rows])
        for r in rows:
            r += _expected_extend(len(r), len(r) + 1, r[-1] if r else -1, page_size, pages)
        assert out.tolist() == [r[-1] for r in rows]

    all_slots = [s for r in rows for s in r]
    assert len(set(all_slots)) == len(all_slots)
    alloc.free(torch.tensor(all_slots))
    assert alloc.available_size() == alloc.size


def test_alloc_extend_out_of_pages_changes_nothing_and_bad_input_raises():
    alloc = _paged_allocator(16, 4)
    assert alloc.alloc_extend([0], [20], [-1], 20) is None
    assert alloc.available_size() == 16
    out = alloc.alloc_extend([0, 0], [3, 0], [-1, -1], 3)
    assert out.tolist() == [4, 5, 6]
    assert alloc.alloc_decode([4], [6]).tolist() == [7]
    assert alloc.alloc_decode([5], [7]).tolist() == [8]
    with pytest.raises(ValueError, match="extend_num_tokens"):
        alloc.alloc_extend([0], [4], [-1], 5)
    with pytest.raises(ValueError, match="prefix_lens <= seq_lens"):
        alloc.alloc_extend([4], [2], [7], -2 + 4)
    with pytest.raises(ValueError, match="last_loc"):
        alloc.alloc_extend([5], [6], [9], 1)
    with pytest.raises(ValueError, match="last_loc"):
        alloc.alloc_decode([6], [9])
    with pytest.raises(ValueError, match="seq_lens"):
        alloc.alloc_decode([0], [-1])
    alloc.free(torch.tensor([4, 5, 6, 7, 8]))
    assert alloc.available_size() == 16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_paged_alloc_on_cuda_matches_cpu():
    cpu, gpu = _paged_allocator(256, 16), PagedTokenToKVPoolAllocator(256, 16, torch.float16, "cuda", None)
    first = [a.alloc_extend([0, 0, 0], [5, 16, 17], [-1, -1, -1], 38) for a in (cpu, gpu)]
    assert first[1].device.type == "cuda" and first[0].tolist() == first[1].tolist()
    pre, seq = torch.tensor([5, 16, 17]), torch.tensor([20, 18, 40])
    last = torch.tensor([first[0][4], first[0][20], first[0][37]])
    out_cpu = cpu.alloc_extend(pre, seq, last, 40)
    out_gpu = gpu.alloc_extend(pre.cuda(), seq.cuda(), last.cuda(), 40, prefix_lens_cpu=pre, seq_lens_cpu=seq)
    assert out_cpu.tolist() == out_gpu.tolist()
    dec_cpu = cpu.alloc_decode(seq + 1, out_cpu[[14, 16, 39]])
    dec_gpu = gpu.alloc_decode((seq + 1).cuda(), out_gpu[[14, 16, 39]], seq_lens_cpu=seq + 1)
    assert dec_cpu.tolist() == dec_gpu.tolist()
    gpu.free(torch.cat((first[1], out_gpu, dec_gpu)))
    assert gpu.available_size() == 256
    with pytest.raises(ValueError, match="double free"):
        gpu.free(out_gpu[:1])
