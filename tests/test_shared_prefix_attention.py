"""Shared-prefix (cascade) decode attention: the plan found from the batch's KV slots, the kernels
against the plain decode on random data, and greedy tokens through the scheduler with the pass on
and off (equal to transformers) across policies, page sizes, chunking, overlap and retraction."""

from __future__ import annotations

import random

import pytest
import torch
from sched_utils import (
    assert_matches_oracle,
    assert_no_leak,
    collect,
    gen_req,
    make_scheduler,
    random_prompts,
)

from radixengine.layers.attention import native_cpu_ops
from radixengine.layers.attention.cascade_plan import build_cascade_plan

needs_native = pytest.mark.skipif(
    not native_cpu_ops.native_available(),
    reason=f"native CPU ops not built: {native_cpu_ops.native_unavailable_reason()}",
)


# The plan ---------------------------------------------------------------------------------------


def _table(rows: list[list[int]], width: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """req_to_token with the given slot rows at shuffled row indices; (table, row indices, lens)."""
    width = max(width, max(len(r) for r in rows) + 4)
    table = torch.zeros(len(rows) + 3, width, dtype=torch.int32)
    order = random.Random(0).sample(range(len(rows) + 3), len(rows))
    for idx, row in zip(order, rows):
        table[idx, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return table, torch.tensor(order), [len(r) for r in rows]


class Slots:
    """Fresh slot numbers, as an allocator hands them out."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _units(plan) -> list[tuple[int, int, list[int]]]:
    ptr = plan.unit_member_ptr.tolist()
    members = plan.unit_members.tolist()
    return sorted(
        (s, e, sorted(members[ptr[u] : ptr[u + 1]]))
        for u, (s, e) in enumerate(zip(plan.unit_start.tolist(), plan.unit_end.tolist()))
    )


def test_plan_finds_a_three_level_tree():
    slots = Slots()
    system = slots.take(100)
    shots = [slots.take(80), slots.take(70)]
    rows = []
    for i in range(8):
        history = slots.take(65) if i % 2 == 0 else history  # noqa: F821 (pairs share a history)
        rows.append(system + shots[i // 4] + history + slots.take(3 + i))
    table, idx, lens = _table(rows)
    plan = build_cascade_plan(table, idx, lens, min_shared_len=64, max_unit_len=10_000)
    assert _units(plan) == sorted(
        [(0, 100, list(range(8))), (100, 180, [0, 1, 2, 3]), (100, 170, [4, 5, 6, 7])]
        + [(180, 245, [i, i + 1]) for i in (0, 2)]
        + [(170, 235, [i, i + 1]) for i in (4, 6)]
    )
    assert plan.own_start.tolist() == [245] * 4 + [235] * 4
    assert plan.own_slot.tolist() == [3] * 8  # three shared levels each
    assert plan.shared_tokens == 100 * 7 + 80 * 3 + 70 * 3 + 65 * 4


def test_plan_is_none_when_nothing_is_shared():
    slots = Slots()
    table, idx, lens = _table([slots.take(200) for _ in range(6)])
    assert build_cascade_plan(table, idx, lens, min_shared_len=8) is None
    assert build_cascade_plan(table[:1], idx[:1], lens[:1], min_shared_len=8) is None


def test_short_prefixes_fold_into_the_longer_ones_below():
    slots = Slots()
    common = slots.take(10)  # too short alone: read as part of each group's unit
    a, b = slots.take(70), slots.take(90)
    rows = [common + a + slots.take(5), common + a + slots.take(6), common + b + slots.take(2)]
    rows += [common + b + slots.take(4), slots.take(300)]  # the last shares nothing
    table, idx, lens = _table(rows)
    plan = build_cascade_plan(table, idx, lens, min_shared_len=64, max_unit_len=10_000)
    assert _units(plan) == [(0, 80, [0, 1]), (0, 100, [2, 3])]
    assert plan.own_start.tolist() == [80, 80, 100, 100, 0]
    assert plan.own_slot.tolist() == [1, 1, 1, 1, 0]
    assert build_cascade_plan(table, idx, lens, min_shared_len=101) is None


def test_plan_cuts_long_units_and_large_groups():
    slots = Slots()
    system = slots.take(300)
    rows = [system + slots.take(2) for _ in range(5)]
    table, idx, lens = _table(rows)
    plan = build_cascade_plan(table, idx, lens, min_shared_len=16, max_unit_len=128, max_unit_members=2)
    pieces = {(s, e) for s, e, _ in _units(plan)}
    assert pieces == {(0, 128), (128, 256), (256, 300)}  # whole key blocks but the last
    assert plan.unit_rows.numel() == 3 * 3  # members in blocks of 2, 2, 1
    assert plan.own_slot.tolist() == [3] * 5 and plan.own_start.tolist() == [300] * 5


def test_units_are_cut_only_as_far_as_the_threads_need():
    slots = Slots()
    system = slots.take(420)
    few_own = [system + slots.take(1) for _ in range(32)]  # the unit is nearly all of the work
    table, idx, lens = _table(few_own)
    assert len(build_cascade_plan(table, idx, lens, num_threads=1).unit_rows) == 1
    pieces = {(s, e) for s, e, _ in _units(build_cascade_plan(table, idx, lens, num_threads=2))}
    assert pieces == {(0, 256), (256, 420)}
    four = {(s, e) for s, e, _ in _units(build_cascade_plan(table, idx, lens, num_threads=4))}
    assert four == {(0, 128), (128, 256), (256, 384), (384, 420)}
    many_own = [system + slots.take(60) for _ in range(32)]  # the own parts balance the threads
    table, idx, lens = _table(many_own)
    assert len(build_cascade_plan(table, idx, lens, num_threads=2).unit_rows) == 1


# The kernels ------------------------------------------------------------------------------------


def _random_batch(
    tree: list[tuple[int, list[int]]],
    own: list[int],
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    seed: int,
):
    """A decode batch whose request b's slots are the concatenation of the shared blocks whose
    member lists name it (in tree order), then `own[b]` slots of its own; slots scattered."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(n for n, _ in tree) + sum(own) + 1
    perm = (torch.randperm(total + 16, generator=gen) + 1).tolist()
    rows = [[] for _ in own]
    used = 0
    for n, members in tree:
        block = perm[used : used + n]
        used += n
        for b in members:
            rows[b] += block
    for b, n in enumerate(own):
        rows[b] += perm[used : used + n]
        used += n
    table, idx, lens = _table(rows)
    num_slots = total + 17
    k = torch.randn(num_slots, kv_heads, dim, generator=gen).to(kv_dtype)
    v = torch.randn(num_slots, kv_heads, dim, generator=gen).to(kv_dtype)
    q = torch.randn(len(own), heads, dim, generator=gen).to(dtype)
    return q, k, v, table, idx, torch.tensor(lens)


CASES = {
    # name: (tree [(length, members)], own lengths, heads, kv heads, dim)
    "one_prefix_bs32": ([(420, list(range(32)))], [60 + i % 7 for i in range(32)], 9, 3, 64),
    # W1 over four LoRA adapters: each adapter's requests share its own copy of the prefix.
    "four_prefixes_bs32": (
        [(420, list(range(g, 32, 4))) for g in range(4)],
        [60 + i % 5 for i in range(32)],
        9,
        3,
        64,
    ),
    "three_levels": (
        [(100, list(range(8))), (80, [0, 1, 2, 3]), (70, [4, 5, 6, 7]), (65, [0, 1]), (90, [6, 7])],
        [1, 2, 3, 4, 5, 6, 7, 8],
        8,
        2,
        64,
    ),
    "some_share": ([(200, [1, 3, 4])], [5, 300, 1, 9, 33, 250], 4, 4, 32),
    "long_8k_mha": ([(8000, [0, 1])], [1, 40], 4, 4, 128),
    "gqa8_short_own": ([(130, list(range(6)))], [1] * 6, 16, 2, 128),
    "head_dim_16": ([(64, [0, 1, 2])], [3, 1, 2], 4, 2, 16),
}


def _check_cascade(case: str, dtype, kv_dtype, cap: float, tolerance: float) -> None:
    tree, own, heads, kv_heads, dim = CASES[case]
    q, k, v, table, idx, lens = _random_batch(
        tree, own, heads, kv_heads, dim, dtype, kv_dtype, seed=len(case)
    )
    plan = build_cascade_plan(table, idx, lens.tolist(), min_shared_len=16)
    assert plan is not None
    expected = native_cpu_ops.decode_attention_reference(
        q, k, v, table, idx, lens, 0.125, logit_cap=cap
    ).float()
    args = (q, k, v, table, idx, lens, 0.125, *plan.kernel_args())
    reference = native_cpu_ops.decode_attention_cascade_reference(*args, logit_cap=cap)
    torch.testing.assert_close(reference.float(), expected, atol=tolerance, rtol=0)
    if native_cpu_ops.native_available():
        for use_amx in (True, False):
            for splits in (0, 3):
                out = native_cpu_ops.decode_attention_cascade(
                    *args, num_kv_splits=splits, logit_cap=cap, use_amx=use_amx
                )
                torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    "dtype,kv_dtype,tolerance",
    [
        (torch.float32, torch.float32, 2e-6),
        (torch.float32, torch.float16, 2e-6),
        (torch.float32, torch.bfloat16, 2e-6),
        (torch.bfloat16, torch.bfloat16, 1.6e-2),  # one bf16 rounding of the output
    ],
    ids=["fp32", "fp32_kv16", "fp32_kvbf16", "bf16"],
)
def test_cascade_equals_plain_decode(case, dtype, kv_dtype, tolerance):
    _check_cascade(case, dtype, kv_dtype, cap=0.0, tolerance=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_with_soft_capping(dtype):
    _check_cascade(
        "three_levels", dtype, dtype, cap=5.0, tolerance=2e-6 if dtype == torch.float32 else 1.6e-2
    )


@needs_native
def test_cascade_with_a_negative_scale():
    """The AMX unit kernel takes the max of unscaled scores, so it needs scale > 0; any other
    scale takes the fp32 path and still matches the plain decode."""
    tree, own, heads, kv_heads, dim = CASES["one_prefix_bs32"]
    q, k, v, table, idx, lens = _random_batch(
        tree, own, heads, kv_heads, dim, torch.bfloat16, torch.bfloat16, 3
    )
    plan = build_cascade_plan(table, idx, lens.tolist(), min_shared_len=16)
    expected = native_cpu_ops.decode_attention_reference(q, k, v, table, idx, lens, -0.125).float()
    out = native_cpu_ops.decode_attention_cascade(
        q, k, v, table, idx, lens, -0.125, *plan.kernel_args(), use_amx=True
    )
    torch.testing.assert_close(out.float(), expected, atol=1.6e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_in_a_shared_key_reaches_every_member(dtype):
    tree, own, heads, kv_heads, dim = CASES["three_levels"]
    q, k, v, table, idx, lens = _random_batch(tree, own, heads, kv_heads, dim, dtype, dtype, seed=5)
    plan = build_cascade_plan(table, idx, lens.tolist(), min_shared_len=16)
    shared_slot = int(table[idx[4], 120])  # in the 70-token block of requests 4..7
    k[shared_slot, 0, 3] = float("nan")
    plain = native_cpu_ops.decode_attention_reference(q, k, v, table, idx, lens, 0.125)
    args = (q, k, v, table, idx, lens, 0.125, *plan.kernel_args())
    outs = [native_cpu_ops.decode_attention_cascade_reference(*args)]
    if native_cpu_ops.native_available():
        outs += [native_cpu_ops.decode_attention_cascade(*args, use_amx=a) for a in (True, False)]
    for out in outs:
        assert torch.equal(out.isnan(), plain.isnan())
        assert out[4:, :2].isnan().all() and not out[:4].isnan().any()


@needs_native
def test_cascade_refuses_an_inconsistent_plan():
    tree, own, heads, kv_heads, dim = CASES["three_levels"]
    q, k, v, table, idx, lens = _random_batch(
        tree, own, heads, kv_heads, dim, torch.float32, torch.float32, 1
    )
    plan = build_cascade_plan(table, idx, lens.tolist(), min_shared_len=16)
    args = list(plan.kernel_args())
    args[6] = torch.zeros_like(args[6])  # own parts from 0: the units would be counted twice
    with pytest.raises(RuntimeError, match="reaches into its member's own keys"):
        native_cpu_ops.decode_attention_cascade(q, k, v, table, idx, lens, 0.125, *args)


# Through the scheduler --------------------------------------------------------------------------

SYSTEM = random_prompts(300, 1, 40, 40)[0]
SHOTS = random_prompts(301, 2, 30, 30)
HISTORIES = random_prompts(302, 4, 20, 20)


def tree_workload(tag: str) -> list:
    """A three-level prefix tree (system prompt, one of two few-shot blocks, one of four user
    histories), unique questions; and two prompts that share nothing."""
    prompts = []
    for i in range(10):
        prefix = SYSTEM + SHOTS[i % 2] + HISTORIES[i % 4]
        prompts.append(prefix + random_prompts(400 + i, 1, 3, 12)[0])
    prompts += random_prompts(303, 2, 30, 60)
    return [gen_req(f"{tag}{i}", p, max_new_tokens=(20, 12, 28)[i % 3]) for i, p in enumerate(prompts)]


def run_waves(sched, reqs: list) -> dict:
    """Some requests, a few steps (they decode while the rest join), then the rest."""
    sched.io.put(*reqs[:5])
    for _ in range(4):
        sched.process_input_requests(sched.recv_requests())
        sched.run_step()
    sched.io.put(*reqs[5:])
    sched.run_until_idle()
    assert_no_leak(sched)
    return collect(sched.io.take_outputs())


def _shared_forwards(sched) -> int:
    return sched.tp_worker.model_runner.attn_backend.num_shared_prefix_forwards


def _check(sched_args: dict, backend: str) -> None:
    for disable in (False, True):
        sched = make_scheduler(
            attention_backend=backend,
            disable_shared_prefix_attention=disable,
            shared_prefix_attention_min_len=16,
            **sched_args,
        )
        before = _shared_forwards(sched)
        reqs = tree_workload("sp")
        assert_matches_oracle(reqs, run_waves(sched, reqs))
        ran = _shared_forwards(sched) - before
        assert (ran == 0) if disable else (ran > 0)


BACKENDS = [pytest.param("native_cpu", marks=needs_native), "torch_native"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight", "lof", "random"])
def test_greedy_tokens_across_policies(policy, overlap, backend):
    _check(dict(schedule_policy=policy, overlap=overlap), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("chunk", [16, -1])
def test_greedy_tokens_across_pages_and_chunks(page_size, chunk, backend):
    _check(dict(page_size=page_size, chunked_prefill_size=chunk, schedule_policy="lpm"), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tokens_with_mixed_chunks(backend):
    _check(dict(chunked_prefill_size=32, enable_mixed_chunk=True, overlap=True), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_tokens_under_retraction(page_size, backend):
    sched = make_scheduler(
        attention_backend=backend,
        shared_prefix_attention_min_len=16,
        page_size=page_size,
        max_total_tokens=640,
        chunked_prefill_size=64,
        init_new_token_ratio=0.05,  # an optimistic estimate: admits more than decode can hold
    )
    before = _shared_forwards(sched)
    reqs = tree_workload("rt")
    for r in reqs:
        r.sampling_params.max_new_tokens = 40
    assert_matches_oracle(reqs, run_waves(sched, reqs))
    assert sched.stats.num_retracted_reqs > 0, "the pool was meant to force retraction"
    assert _shared_forwards(sched) > before


# The switch ---------------------------------------------------------------------------------------


def test_switch_and_min_len_flags():
    from radixengine.launch_server import parse_args

    args = parse_args(["--disable-shared-prefix-attention", "--shared-prefix-attention-min-len", "32"])
    assert args.disable_shared_prefix_attention and args.shared_prefix_attention_min_len == 32
    default = parse_args([])
    assert not default.disable_shared_prefix_attention and default.shared_prefix_attention_min_len == 64
    with pytest.raises(SystemExit):
        parse_args(["--shared-prefix-attention-min-len", "0"])
