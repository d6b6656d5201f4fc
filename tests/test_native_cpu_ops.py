"""The native CPU ops (radixengine/csrc) equal their pure-torch references.

Random ragged batches over a paged pool: random (non-contiguous) slots, rows of req_to_token
sharing prefix slots, GQA ratios 1 and 3, head_dim 64 and 128, float32 (within 1e-5) and
bfloat16 (within bf16 rounding). Positions past a request's length hold valid but unrelated
slots, so reading beyond seq_len shows up as a mismatch.

Every test runs once per instruction-set level this CPU can execute (``avx512``, ``avx2``,
``portable``: the modules of ``radixengine/utils/cpu_isa.py``), with that level's module in
place of the one loaded at import.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import pytest
import torch

from radixengine.layers.attention import native_cpu_ops as ops
from radixengine.utils import cpu_isa

needs_native = pytest.mark.skipif(
    not ops.native_available(),
    reason=f"native CPU extension not built: {ops.native_unavailable_reason()}",
)
NAN = float("nan")


def _levels_under_test() -> list[str | None]:
    return list(cpu_isa.supported_levels()) if ops.native_available() else [None]


@pytest.fixture(autouse=True, params=_levels_under_test(), ids=lambda level: level or "no-native")
def native_level(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """The ISA level this run of a test uses: its module replaces the loaded one for the test."""
    level = request.param
    if level is None or level == ops.native_level():
        return level
    try:
        module = ops.load_native_level(level)
    except ModuleNotFoundError:
        pytest.skip(f"the {level} build is missing (test_every_level_this_cpu_runs_is_built says so)")
    monkeypatch.setattr(ops, "_native", module)
    return level


def _binding_parameters(kernel) -> list[tuple[str, str | None]]:
    """(name, default) of a pybind11 function, from its signature line `name(a: T, b: T = 0) -> R`."""
    inside = kernel.__doc__.splitlines()[0].split("(", 1)[1].rsplit(")", 1)[0]
    params = []
    for part in inside.split(", "):
        name, _, rest = part.partition(": ")
        params.append((name, rest.split(" = ")[1] if " = " in rest else None))
    return params


@needs_native
@pytest.mark.parametrize("name", sorted(ops.OPS))
def test_each_kernel_takes_the_parameters_of_its_reference(name: str) -> None:
    """One declaration drives both paths: an op passes its arguments, keywords included, to the
    kernel or to the reference as they come."""
    reference = inspect.signature(ops.OPS[name]).parameters.values()
    expected = [(p.name, None if p.default is p.empty else repr(p.default)) for p in reference]
    assert _binding_parameters(getattr(ops.require_native(), name)) == expected
    assert inspect.signature(getattr(ops, name)) == inspect.signature(ops.OPS[name])


TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2}}


def test_native_extension_is_built() -> None:
    """CI builds the extension; only an explicit opt-out lets the suite run without it."""
    if os.environ.get("RADIXENGINE_ALLOW_NO_NATIVE") == "1":
        pytest.skip("RADIXENGINE_ALLOW_NO_NATIVE=1")
    assert ops.native_available(), (
        f"the native CPU extension is not available ({ops.native_unavailable_reason()}); "
        "build it with `pip install --no-build-isolation -e .` (or set RADIXENGINE_ALLOW_NO_NATIVE=1)"
    )
    assert ops.native_level() == cpu_isa.chosen_level()[0]


def test_every_level_this_cpu_runs_is_built(native_level: str | None) -> None:
    """The package build holds a module per level, each compiled for its own vector path."""
    if native_level is None:
        pytest.skip(f"native CPU extension not built: {ops.native_unavailable_reason()}")
    assert ops.native_isa() == native_level  # the module this run of the tests uses
    if os.environ.get("RADIXENGINE_JIT_BUILD") == "1":
        return  # a JIT build compiles only the level picked at import
    for level in cpu_isa.supported_levels():
        assert ops.load_native_level(level).isa() == level


def test_require_native_names_the_reason() -> None:
    if ops.native_available():
        assert ops.require_native() is not None
    else:
        with pytest.raises(RuntimeError, match="not available"):
            ops.require_native()


@dataclass
class Batch:
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor


def make_batch(
    gen: torch.Generator, bs: int, max_len: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> Batch:
    seq_lens = torch.randint(1, max_len + 1, (bs,), generator=gen)
    num_slots = int(seq_lens.sum()) + 8
    slots = torch.randperm(num_slots - 1, generator=gen) + 1  # slot 0 is padding
    max_reqs, context_len = bs + 3, max_len + 5
    # Unused positions hold valid slots too: reading past seq_len would change the result.
    req_to_token = torch.randint(1, num_slots, (max_reqs, context_len), generator=gen, dtype=torch.int32)
    rows = torch.randperm(max_reqs, generator=gen)[:bs]
    offset = 0
    for i in range(bs):
        n = int(seq_lens[i])
        req_to_token[rows[i], :n] = slots[offset : offset + n].to(torch.int32)
        offset += n
        if i % 2 == 1:  # share a prefix with the previous request (as the radix cache does)
            shared = min(n, int(seq_lens[i - 1])) // 2
            req_to_token[rows[i], :shared] = req_to_token[rows[i - 1], :shared]
    shape = (num_slots, num_kv_heads, head_dim)
    k_buffer = torch.randn(shape, generator=gen).to(dtype)
    v_buffer = torch.randn(shape, generator=gen).to(dtype)
    return Batch(k_buffer, v_buffer, req_to_token, rows.to(torch.int64), seq_lens)


CONFIGS = [
    (dtype, group, head_dim, seed)
    for dtype in (torch.float32, torch.bfloat16)
    for group in (1, 3)
    for head_dim in (64, 128)
    for seed in range(3)
]


def _id(cfg: tuple) -> str:
    dtype, group, head_dim, seed = cfg
    return f"{str(dtype).removeprefix('torch.')}-g{group}-d{head_dim}-s{seed}"


def test_references_match_explicit_softmax() -> None:
    """The references themselves: explicit softmax over the visible positions, GQA by head // group."""
    gen = torch.Generator().manual_seed(3)
    batch = make_batch(gen, 3, 40, 2, 64, torch.float32)
    ext = torch.minimum(batch.seq_lens, torch.tensor([5, 1, 40]))
    start = torch.cumsum(ext, 0) - ext
    q = torch.randn(int(ext.sum()), 6, 64, generator=gen)
    out = ops.extend_attention_reference(
        q,
        batch.k_buffer,
        batch.v_buffer,
        batch.req_to_token,
        batch.req_pool_indices,
        batch.seq_lens,
        ext,
        start,
        0.3,
    )
    qd = torch.randn(3, 6, 64, generator=gen)
    out_d = ops.decode_attention_reference(
        qd, batch.k_buffer, batch.v_buffer, batch.req_to_token, batch.req_pool_indices, batch.seq_lens, 0.3
    )

    def explicit(qv: torch.Tensor, row: int, visible: int, head: int) -> torch.Tensor:
        slots = batch.req_to_token[row, :visible].long()
        k, v = batch.k_buffer[slots, head // 3], batch.v_buffer[slots, head // 3]
        return torch.softmax(k @ qv * 0.3, 0) @ v

    for i in range(3):
        row, n = int(batch.req_pool_indices[i]), int(batch.seq_lens[i])
        for h in range(6):
            torch.testing.assert_close(out_d[i, h], explicit(qd[i, h], row, n, h))
            for j in range(int(ext[i])):
                visible = n - int(ext[i]) + j + 1
                torch.testing.assert_close(
                    out[int(start[i]) + j, h], explicit(q[int(start[i]) + j, h], row, visible, h)
                )


@needs_native
@pytest.mark.parametrize("cfg", CONFIGS, ids=_id)
def test_decode_matches_reference(cfg: tuple) -> None:
    dtype, group, head_dim, seed = cfg
    gen = torch.Generator().manual_seed(1000 + seed * 7 + group * 31 + head_dim)
    num_kv_heads = int(torch.randint(1, 4, (1,), generator=gen))
    bs = int(torch.randint(1, 10, (1,), generator=gen))
    batch = make_batch(gen, bs, 300, num_kv_heads, head_dim, dtype)
    num_heads = num_kv_heads * group
    # q as a strided view (as split from a fused qkv projection).
    qkv = torch.randn(bs, num_heads + 2, head_dim, generator=gen).to(dtype)
    q = qkv[:, :num_heads]
    scale = head_dim**-0.5
    args = (
        q,
        batch.k_buffer,
        batch.v_buffer,
        batch.req_to_token,
        batch.req_pool_indices,
        batch.seq_lens,
        scale,
    )
    expected = ops.decode_attention_reference(*args)
    for splits in (0, 1, 3, 7):  # 0: automatic; 7 leaves some splits empty for short requests
        out = ops.decode_attention(*args, num_kv_splits=splits)
        assert out.dtype == dtype and out.shape == (bs, num_heads, head_dim)
        torch.testing.assert_close(out.float(), expected.float(), **TOL[dtype], msg=f"splits={splits}")


@needs_native
@pytest.mark.parametrize("cfg", CONFIGS, ids=_id)
def test_extend_matches_reference(cfg: tuple) -> None:
    dtype, group, head_dim, seed = cfg
    gen = torch.Generator().manual_seed(2000 + seed * 7 + group * 31 + head_dim)
    num_kv_heads = int(torch.randint(1, 4, (1,), generator=gen))
    bs = int(torch.randint(1, 10, (1,), generator=gen))
    batch = make_batch(gen, bs, 300, num_kv_heads, head_dim, dtype)
    # New tokens per request: the whole sequence (no prefix), one token, or a random split.
    choice = torch.randint(0, 3, (bs,), generator=gen)
    random_ext = (torch.rand(bs, generator=gen) * batch.seq_lens).long().clamp(min=1)
    extend_seq_lens = torch.where(choice == 0, batch.seq_lens, torch.where(choice == 1, 1, random_ext))
    extend_start_loc = torch.cumsum(extend_seq_lens, 0) - extend_seq_lens
    num_heads = num_kv_heads * group
    q = torch.randn(int(extend_seq_lens.sum()), num_heads, head_dim, generator=gen).to(dtype)
    args = (
        q,
        batch.k_buffer,
        batch.v_buffer,
        batch.req_to_token,
        batch.req_pool_indices,
        batch.seq_lens,
        extend_seq_lens,
        extend_start_loc,
        head_dim**-0.5,
    )
    expected = ops.extend_attention_reference(*args)
    out = ops.extend_attention(*args)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected.float(), **TOL[dtype])


@needs_native
@pytest.mark.parametrize(
    "group, head_dim, logit_cap",
    [(1, 32, 0.0), (3, 64, 0.0), (3, 64, 20.0), (8, 128, 0.0), (4, 256, 0.0), (16, 64, 0.0)],
)
def test_extend_in_bf16_matches_reference_across_tile_shapes(group, head_dim, logit_cap) -> None:
    """bf16 extend runs on AMX tiles where the CPU has them (query blocks of 96 / group queries,
    64-key blocks, the causal limit per query row): long cached prefixes and new tokens that cross
    the block edges, soft-capping, groups up to 16."""
    gen = torch.Generator().manual_seed(head_dim + group)
    batch = make_batch(gen, 4, 300, 2, head_dim, torch.bfloat16)
    extend_seq_lens = torch.minimum(batch.seq_lens, torch.tensor([1, 33, 97, 300]))
    extend_start_loc = torch.cumsum(extend_seq_lens, 0) - extend_seq_lens
    q = torch.randn(int(extend_seq_lens.sum()), 2 * group, head_dim, generator=gen).to(torch.bfloat16)
    args = (q, batch.k_buffer, batch.v_buffer, batch.req_to_token, batch.req_pool_indices)
    lens = (batch.seq_lens, extend_seq_lens, extend_start_loc, head_dim**-0.5, -1, logit_cap)
    expected = ops.extend_attention_reference(*args, *lens)
    torch.testing.assert_close(
        ops.extend_attention(*args, *lens).float(), expected.float(), **TOL[torch.bfloat16]
    )


@needs_native
def test_decode_one_thread_and_long_sequence() -> None:
    """Automatic splitting at batch 1 (several threads) and none with one thread agree."""
    gen = torch.Generator().manual_seed(5)
    num_slots, seq_len = 1200, 1000
    k_buffer, v_buffer = (
        torch.randn(num_slots, 3, 64, generator=gen),
        torch.randn(num_slots, 3, 64, generator=gen),
    )
    req_to_token = torch.zeros(2, seq_len, dtype=torch.int32)
    req_to_token[1] = (torch.randperm(num_slots - 1, generator=gen)[:seq_len] + 1).to(torch.int32)
    q = torch.randn(1, 9, 64, generator=gen)
    rows, seq_lens = torch.tensor([1]), torch.tensor([seq_len])
    args = (q, k_buffer, v_buffer, req_to_token, rows, seq_lens, 0.125)
    expected = ops.decode_attention_reference(*args)
    threads = torch.get_num_threads()
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            torch.testing.assert_close(ops.decode_attention(*args), expected, **TOL[torch.float32])
    finally:
        torch.set_num_threads(threads)


@needs_native
def test_empty_batch_and_bad_slot() -> None:
    gen = torch.Generator().manual_seed(6)
    batch = make_batch(gen, 2, 20, 2, 64, torch.float32)
    empty = torch.zeros(0, dtype=torch.int64)
    out = ops.decode_attention(
        torch.randn(0, 4, 64), batch.k_buffer, batch.v_buffer, batch.req_to_token, empty, empty, 0.125
    )
    assert out.shape == (0, 4, 64)
    batch.req_to_token[batch.req_pool_indices[1], 0] = batch.k_buffer.shape[0]  # one past the end
    with pytest.raises(RuntimeError, match="outside the KV buffer"):
        ops.decode_attention(
            torch.randn(2, 4, 64),
            batch.k_buffer,
            batch.v_buffer,
            batch.req_to_token,
            batch.req_pool_indices,
            batch.seq_lens,
            0.125,
        )
    with pytest.raises(RuntimeError, match="head_dim"):
        ops.decode_attention(
            torch.randn(2, 4, 40),
            torch.zeros(8, 2, 40),
            torch.zeros(8, 2, 40),
            batch.req_to_token,
            batch.req_pool_indices,
            batch.seq_lens,
            0.125,
        )


@needs_native
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seed", range(2))
def test_float32_queries_over_16bit_kv_cache(kv_dtype: torch.dtype, head_dim: int, seed: int) -> None:
    """`--kv-cache-dtype` under a float32 model: K/V stored in 16 bits, widened on load, math in
    float32, so the kernels match the float32 reference over the same stored values to 1e-5."""
    gen = torch.Generator().manual_seed(3000 + seed + head_dim)
    num_kv_heads, group, bs = 3, 3, 7
    batch = make_batch(gen, bs, 300, num_kv_heads, head_dim, kv_dtype)
    assert batch.k_buffer.dtype == kv_dtype
    table = (batch.req_to_token, batch.req_pool_indices, batch.seq_lens)
    q = torch.randn(bs, num_kv_heads * group, head_dim, generator=gen)
    decode_args = (q, batch.k_buffer, batch.v_buffer, *table, head_dim**-0.5)
    out = ops.decode_attention(*decode_args)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ops.decode_attention_reference(*decode_args), **TOL[torch.float32])

    ext = (torch.rand(bs, generator=gen) * batch.seq_lens).long().clamp(min=1)
    start = torch.cumsum(ext, 0) - ext
    qe = torch.randn(int(ext.sum()), num_kv_heads * group, head_dim, generator=gen)
    extend_args = (qe, batch.k_buffer, batch.v_buffer, *table, ext, start, head_dim**-0.5)
    torch.testing.assert_close(
        ops.extend_attention(*extend_args), ops.extend_attention_reference(*extend_args), **TOL[torch.float32]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 37, 600])
def test_set_kv_buffer_matches_index_copy(
    dtype: torch.dtype, src_dtype: torch.dtype, num_tokens: int
) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    num_slots, heads, head_dim = 1024, 3, 64
    loc = torch.randperm(num_slots, generator=gen)[:num_tokens]
    # k and v as strided views of a fused projection output.
    qkv = torch.randn(num_tokens, (9 + 2 * heads) * head_dim, generator=gen).to(src_dtype)
    k = qkv[:, 9 * head_dim : (9 + heads) * head_dim].view(num_tokens, heads, head_dim)
    v = qkv[:, (9 + heads) * head_dim :].view(num_tokens, heads, head_dim)
    k_buf, v_buf = (
        torch.randn(num_slots, heads, head_dim).to(dtype),
        torch.randn(num_slots, heads, head_dim).to(dtype),
    )
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    ops.set_kv_buffer(k_buf, v_buf, loc, k, v)
    ops.set_kv_buffer_reference(k_ref, v_ref, loc, k, v)
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)
    # A transposed (non-unit last stride) source is accepted too.
    k_t = k.transpose(1, 2).contiguous().transpose(1, 2)
    ops.set_kv_buffer(k_buf, v_buf, loc, k_t, v)
    assert torch.equal(k_buf, k_ref)
    with pytest.raises(RuntimeError, match="outside the KV buffer"):
        ops.set_kv_buffer(k_buf, v_buf, loc + num_slots, k, v)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 32, 300])
@pytest.mark.parametrize("hidden", [576, 100])
def test_rms_norm_matches_reference(dtype: torch.dtype, num_tokens: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens + hidden)
    x = (torch.randn(num_tokens, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    torch.testing.assert_close(
        ops.rms_norm(x, weight, 1e-6), ops.rms_norm_reference(x, weight, 1e-6), **TOL[dtype]
    )
    x_ref, r_ref = x.clone(), residual.clone()
    ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    ops.fused_add_rms_norm_reference(x_ref, r_ref, weight, 1e-6)
    assert torch.equal(residual, r_ref)
    torch.testing.assert_close(x, x_ref, **TOL[dtype])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 32, 300])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 128), (64, 36)])
def test_rotary_embedding_matches_reference(
    dtype: torch.dtype, num_tokens: int, head_dim: int, rotary_dim: int
) -> None:
    from radixengine.layers.rotary_embedding import get_rope

    rope = get_rope(head_dim, rotary_dim, 4096, 10000.0, None, dtype)
    gen = torch.Generator().manual_seed(num_tokens + head_dim)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    # q and k heads as a strided view of a fused qkv output (9 + 3 heads, then 3 v heads).
    qkv = torch.randn(num_tokens, 15, head_dim, generator=gen).to(dtype)
    qk = qkv[:, :12]
    expected = rope(positions, qk.clone())
    v_before = qkv[:, 12:].clone()
    ops.rotary_embedding(positions, qk, rope.cos_sin_cache, rotary_dim)
    torch.testing.assert_close(qk, expected, **TOL[dtype])
    assert torch.equal(qkv[:, 12:], v_before)
    ref = qkv[:, :12].clone()
    ops.rotary_embedding_reference(positions, ref, rope.cos_sin_cache, rotary_dim)  # rotates again
    ops.rotary_embedding(positions, qk, rope.cos_sin_cache, rotary_dim)
    torch.testing.assert_close(qk, ref, **TOL[dtype])


def _extend_lens(seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A quarter of each sequence (at least one token) as new tokens; the rest is the prefix."""
    ext = (seq_lens // 4).clamp(min=1)
    return ext, torch.cumsum(ext, 0) - ext


def _attention_pair(batch: Batch, q_decode: torch.Tensor, q_extend: torch.Tensor, splits: int):
    """(native, reference) outputs of decode (with ``splits``) and of extend over ``batch``."""
    table = (batch.k_buffer, batch.v_buffer, batch.req_to_token, batch.req_pool_indices, batch.seq_lens)
    scale = q_decode.shape[-1] ** -0.5
    ext, start = _extend_lens(batch.seq_lens)
    decode = (
        ops.decode_attention(q_decode, *table, scale, num_kv_splits=splits),
        ops.decode_attention_reference(q_decode, *table, scale),
    )
    extend = (
        ops.extend_attention(q_extend, *table, ext, start, scale),
        ops.extend_attention_reference(q_extend, *table, ext, start, scale),
    )
    return decode, extend


def _nan_batch(dtype: torch.dtype) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(41)
    batch = make_batch(gen, 6, 300, 2, 64, dtype)
    q_decode = torch.randn(6, 6, 64, generator=gen).to(dtype)
    ext, _ = _extend_lens(batch.seq_lens)
    q_extend = torch.randn(int(ext.sum()), 6, 64, generator=gen).to(dtype)
    return batch, q_decode, q_extend


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("where", ["k", "v"])
def test_nan_in_a_visible_kv_row_reaches_the_output(where: str, dtype: torch.dtype) -> None:
    """A NaN in a K or V row that queries attend over (a 16-bit KV overflow, say) shows in the
    output exactly where the reference's NaN is: every feature of the heads reading a NaN key, the
    NaN's feature for a NaN value; decode with any KV split, and extend."""
    batch, q_decode, q_extend = _nan_batch(dtype)
    buffer = batch.k_buffer if where == "k" else batch.v_buffer
    ext, _ = _extend_lens(batch.seq_lens)
    # Request 0 at position 0 (seen by every query), request 2 at the last position of its prefix
    # (or 0), in the second KV head: positions every query of the request sees, decode and extend.
    for i, head, dim in ((0, 0, 5), (2, 1, 9)):
        row = int(batch.req_pool_indices[i])
        pos = max(0, int(batch.seq_lens[i] - ext[i]) - 1) if i == 2 else 0
        buffer[int(batch.req_to_token[row, pos]), head, dim] = NAN
    for splits in (0, 1, 3, 7):
        decode, extend = _attention_pair(batch, q_decode, q_extend, splits)
        for out, expected in (decode, extend):
            assert expected.isnan().any() and not expected.isnan().all()
            assert torch.equal(out.isnan(), expected.isnan()), f"splits={splits}"


@needs_native
def test_nan_key_of_a_new_token_reaches_the_queries_that_see_it() -> None:
    """Extend: a NaN K at new-token position p gives NaN at the queries at p and after it (as the
    reference does) and leaves the earlier queries, which never see that key, finite. (The SDPA
    reference adds the mask's -inf to the NaN score and spreads it to those too.)"""
    gen = torch.Generator().manual_seed(43)
    seq_len, ext, p = 150, 100, 120  # queries at positions 50..149; the NaN key at 120
    k_buffer, v_buffer = torch.randn(200, 1, 64, generator=gen), torch.randn(200, 1, 64, generator=gen)
    req_to_token = (torch.randperm(199, generator=gen)[:seq_len] + 1).to(torch.int32).unsqueeze(0)
    k_buffer[int(req_to_token[0, p]), 0, 3] = NAN
    q = torch.randn(ext, 3, 64, generator=gen)
    table = (k_buffer, v_buffer, req_to_token, torch.tensor([0]), torch.tensor([seq_len]))
    args = (q, *table, torch.tensor([ext]), torch.tensor([0]), 0.125)
    out, expected = ops.extend_attention(*args), ops.extend_attention_reference(*args)
    first = p - (seq_len - ext)  # the query at position p
    assert out[first:].isnan().all() and expected[first:].isnan().all()
    assert torch.isfinite(out[:first]).all()


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_in_slots_no_query_sees_does_not_leak(dtype: torch.dtype) -> None:
    """NaN K and V in every slot outside the requests' visible positions (the padding slot, free
    slots, and the slots that req_to_token holds past each request's length): all outputs stay
    finite, as the reference's do."""
    batch, q_decode, q_extend = _nan_batch(dtype)
    visible = set()
    for row, n in zip(batch.req_pool_indices.tolist(), batch.seq_lens.tolist()):
        visible.update(batch.req_to_token[row, :n].tolist())
    hidden = torch.tensor(sorted(set(range(batch.k_buffer.shape[0])) - visible))
    row0, n0 = int(batch.req_pool_indices[0]), int(batch.seq_lens[0])
    assert set(batch.req_to_token[row0, n0:].tolist()) - visible  # past seq_len: hidden slots too
    batch.k_buffer[hidden] = NAN
    batch.v_buffer[hidden] = NAN
    for splits in (0, 1, 3, 7):
        decode, extend = _attention_pair(batch, q_decode, q_extend, splits)
        for out, expected in (decode, extend):
            assert torch.isfinite(expected).all()
            assert torch.isfinite(out).all(), f"splits={splits}"


WINDOW_CAP = [(0, 0.0), (6, 0.0), (50, 0.0), (-1, 2.5), (17, 2.5)]


def test_references_window_and_cap_match_explicit_softmax() -> None:
    """With a sliding window a query at position p sees positions p - window .. p; soft-capped
    scores are cap * tanh(score / cap)."""
    gen = torch.Generator().manual_seed(5)
    batch = make_batch(gen, 3, 40, 2, 64, torch.float32)
    ext = torch.minimum(batch.seq_lens, torch.tensor([5, 1, 40]))
    start = torch.cumsum(ext, 0) - ext
    q = torch.randn(int(ext.sum()), 6, 64, generator=gen)
    qd = torch.randn(3, 6, 64, generator=gen)
    pool = (batch.k_buffer, batch.v_buffer, batch.req_to_token, batch.req_pool_indices, batch.seq_lens)
    window, cap = 4, 1.5
    out = ops.extend_attention_reference(q, *pool, ext, start, 0.3, window, cap)
    out_d = ops.decode_attention_reference(qd, *pool, 0.3, window_left=window, logit_cap=cap)

    def explicit(qv: torch.Tensor, row: int, visible: int, head: int) -> torch.Tensor:
        slots = batch.req_to_token[row, max(0, visible - 1 - window) : visible].long()
        k, v = batch.k_buffer[slots, head // 3], batch.v_buffer[slots, head // 3]
        return torch.softmax(torch.tanh(k @ qv * 0.3 / cap) * cap, 0) @ v

    for i in range(3):
        row, n = int(batch.req_pool_indices[i]), int(batch.seq_lens[i])
        for h in range(6):
            torch.testing.assert_close(out_d[i, h], explicit(qd[i, h], row, n, h))
            for j in range(int(ext[i])):
                t = int(start[i]) + j
                torch.testing.assert_close(out[t, h], explicit(q[t, h], row, n - int(ext[i]) + j + 1, h))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window_left,logit_cap", WINDOW_CAP)
def test_window_and_cap_match_reference(dtype: torch.dtype, group: int, window_left: int, logit_cap: float):
    """Extend (no prefix, one token, a random split: query blocks whose later queries see none of
    the first key block's keys) and decode (every split count) with a sliding window and
    soft-capping, against the references."""
    gen = torch.Generator().manual_seed(3000 + group * 31 + window_left)
    batch = make_batch(gen, 7, 300, 2, 64, dtype)
    choice = torch.arange(7) % 3
    random_ext = (torch.rand(7, generator=gen) * batch.seq_lens).long().clamp(min=1)
    ext = torch.where(choice == 0, batch.seq_lens, torch.where(choice == 1, 1, random_ext))
    start = torch.cumsum(ext, 0) - ext
    pool = (batch.k_buffer, batch.v_buffer, batch.req_to_token, batch.req_pool_indices, batch.seq_lens)
    q = torch.randn(int(ext.sum()), 2 * group, 64, generator=gen).to(dtype)
    extra = (window_left, logit_cap)
    expected = ops.extend_attention_reference(q, *pool, ext, start, 0.125, *extra)
    torch.testing.assert_close(
        ops.extend_attention(q, *pool, ext, start, 0.125, *extra).float(), expected.float(), **TOL[dtype]
    )
    qd = torch.randn(7, 2 * group, 64, generator=gen).to(dtype)
    expected = ops.decode_attention_reference(qd, *pool, 0.125, window_left=window_left, logit_cap=logit_cap)
    for splits in (0, 1, 3, 7):
        out = ops.decode_attention(qd, *pool, 0.125, splits, *extra)
        torch.testing.assert_close(out.float(), expected.float(), **TOL[dtype], msg=f"splits={splits}")
    if window_left >= 0:  # the window matters on these lengths
        whole = ops.decode_attention_reference(qd, *pool, 0.125, logit_cap=logit_cap)
        assert not torch.allclose(whole.float(), expected.float(), atol=1e-2)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("seed", range(3))
def test_short_extend_matches_reference(dtype: torch.dtype, group: int, seed: int) -> None:
    """A verify step's attention: at most 8 new tokens a request (some none) over prefixes of
    0-300 tokens runs as a decode of several queries a request (short_as_decode; on AMX tiles
    only for one token a request); both it and the extend tasks equal the reference, with and
    without soft-capping, one request (KV splits) or several."""
    gen = torch.Generator().manual_seed(5000 + 97 * seed + group)
    bs = 1 if seed == 0 else int(torch.randint(2, 10, (1,), generator=gen))
    batch = make_batch(gen, bs, 300, 2, 64, dtype)
    ext = torch.minimum(torch.randint(0 if seed == 2 else 1, 9, (bs,), generator=gen), batch.seq_lens)
    ext[0] = 1 if seed == 1 else ext[0].clamp(min=1)
    start = torch.cumsum(ext, 0) - ext
    q = torch.randn(int(ext.sum()), 2 * group, 64, generator=gen).to(dtype)
    table = (q, batch.k_buffer, batch.v_buffer, batch.req_to_token, batch.req_pool_indices, batch.seq_lens)
    for logit_cap in (0.0, 5.0):
        args = (*table, ext, start, 0.125, -1, logit_cap)
        expected = ops.extend_attention_reference(*args)
        for as_decode in (True, False):
            out = ops.extend_attention(*args, short_as_decode=as_decode)
            torch.testing.assert_close(out.float(), expected.float(), **TOL[dtype])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_in_a_short_extend_reaches_only_the_queries_that_see_it(dtype: torch.dtype) -> None:
    """A NaN K at a request's first cached position reaches all its queries, as in the reference;
    one at its last new token only the query there: the earlier queries never see that key (the
    SDPA reference adds the mask's -inf to the NaN score and spreads it to those too)."""
    gen = torch.Generator().manual_seed(47)
    batch = make_batch(gen, 3, 300, 1, 64, dtype)
    ext = torch.tensor([4, 1, 3]).minimum(batch.seq_lens)
    start = torch.cumsum(ext, 0) - ext
    q = torch.randn(int(ext.sum()), 3, 64, generator=gen).to(dtype)
    rows, lens = batch.req_pool_indices.tolist(), batch.seq_lens.tolist()
    batch.k_buffer[int(batch.req_to_token[rows[0], lens[0] - 1]), 0, 7] = NAN
    batch.k_buffer[int(batch.req_to_token[rows[2], 0]), 0, 2] = NAN
    args = (
        q,
        batch.k_buffer,
        batch.v_buffer,
        batch.req_to_token,
        batch.req_pool_indices,
        batch.seq_lens,
        ext,
        start,
        0.125,
    )
    expected = ops.extend_attention_reference(*args)
    out = ops.extend_attention(*args)
    last = int(ext[0]) - 1
    assert out[last].isnan().all() and torch.isfinite(out[:last]).all()
    assert torch.equal(out[start[1] :].isnan(), expected[start[1] :].isnan())
    assert out[int(start[2]) :].isnan().all() and torch.isfinite(out[int(start[1])]).all()
