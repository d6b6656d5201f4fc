"""CPU attention over the paged KV pool: native kernels vs torch gather + SDPA.

One "step" runs the op once per layer over 30 layers, each layer with its own K/V buffers (so
the pool does not sit in cache the way a single repeated layer would), with SmolLM2-135M's
attention shapes (9 query heads, 3 kv heads, head_dim 64). Slots are a random permutation of the
pool, as after a while of serving.

  decode  batch 1, 8, 32, 64 x 512 cached tokens
  extend  512 new tokens with 0 and 400 cached
  short_extend  a verify step: 8 requests x 1, 3, 8 new tokens over 260 cached, run as a decode of
            several queries a request and (ablation, short_as_decode=False) as extend tasks
  kv write  the step's new K/V written at out_cache_loc (32 and 512 tokens)
  rmsnorm+residual, rotary  the layer's fused small ops (2 norms and 1 rotary per layer) at
            1, 32 and 512 tokens, vs the torch modules (RMSNorm, RotaryEmbedding)

Torch baselines, in the KV dtype: `torch` gathers each request's K/V through req_to_token and
calls SDPA per request (SGLang's torch_native form); `torch_batched` (decode) gathers the whole
batch with one index_select into [bs, kv_heads, len, D] and calls SDPA once with the queries
grouped [bs, kv_heads, group, D] (radixengine's torch_native form). speed-up = the faster torch
baseline / native.

    .venv/bin/python benchmarks/bench_attention_cpu.py --out bench_results/attention_cpu.json
    .venv/bin/python benchmarks/bench_attention_cpu.py --cases short_extend --threads 1 --clock thread
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from radixengine.layers.attention import native_cpu_ops as ops


@dataclass
class Shapes:
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    num_layers: int = 30


@dataclass
class Result:
    case: str
    dtype: str
    batch: int
    cached: int
    new_tokens: int
    native_ms: float
    torch_ms: float
    torch_batched_ms: float | None
    speedup: float  # best torch / native


@dataclass
class Pool:
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor


def make_pool(shapes: Shapes, dtype: torch.dtype, seq_lens: list[int], seed: int = 0) -> Pool:
    gen = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    num_slots = total + 1  # slot 0 is padding
    slots = torch.randperm(total, generator=gen) + 1
    bs = len(seq_lens)
    req_to_token = torch.zeros(bs + 4, max(seq_lens) + 16, dtype=torch.int32)
    rows = torch.randperm(bs + 4, generator=gen)[:bs]
    offset = 0
    for row, n in zip(rows.tolist(), seq_lens):
        req_to_token[row, :n] = slots[offset : offset + n].to(torch.int32)
        offset += n
    shape = (num_slots, shapes.num_kv_heads, shapes.head_dim)
    k = [torch.randn(shape, generator=gen).to(dtype) for _ in range(shapes.num_layers)]
    v = [torch.randn(shape, generator=gen).to(dtype) for _ in range(shapes.num_layers)]
    return Pool(k, v, req_to_token, rows.to(torch.long), torch.tensor(seq_lens, dtype=torch.long))


def time_step(fn: Callable[[], object], args: argparse.Namespace) -> float:
    """Milliseconds of fn() over repeated calls after one warm-up: the median, or the minimum
    with --stat min. --clock thread times the calling thread's CPU time (one thread only: on a
    shared machine wall time includes waiting for a core)."""
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < args.max_iters and (len(times) < 3 or time.perf_counter() - start < args.min_time):
        t0 = clock()
        fn()
        times.append((clock() - t0) * 1e3)
    return min(times) if args.stat == "min" else statistics.median(times)


# ----------------------------------------------------------------------------------------------
# Torch baselines


def torch_decode(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, pool: Pool, scale: float
) -> torch.Tensor:
    out = torch.empty_like(q)
    for i, (row, n) in enumerate(zip(pool.req_pool_indices.tolist(), pool.seq_lens.tolist())):
        slots = pool.req_to_token[row, :n].long()
        k = k_buf[slots].transpose(0, 1)  # [Hkv, n, D]
        v = v_buf[slots].transpose(0, 1)
        o = F.scaled_dot_product_attention(q[i].unsqueeze(1), k, v, scale=scale, enable_gqa=True)
        out[i] = o.squeeze(1)
    return out


def decode_head_rows(pool: Pool, num_kv_heads: int) -> torch.Tensor:
    """Rows of the pool viewed as [slots * kv_heads, head_dim], ordered [bs, kv_heads, max_len]
    (once per step, as a backend's metadata)."""
    max_len = int(pool.seq_lens.max())
    slots = pool.req_to_token[pool.req_pool_indices, :max_len].long()
    return (slots.unsqueeze(1) * num_kv_heads + torch.arange(num_kv_heads).view(1, -1, 1)).flatten()


def torch_decode_batched(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    pool: Pool,
    head_rows: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The whole batch gathered as [bs, kv_heads, max_len, D] and one SDPA with queries grouped
    [bs, kv_heads, group, D] (the fastest torch form measured for the torch_native backend)."""
    bs, num_heads, dim = q.shape
    kv_heads = k_buf.shape[1]
    max_len = head_rows.numel() // (bs * kv_heads)
    k = k_buf.view(-1, dim).index_select(0, head_rows).view(bs, kv_heads, max_len, dim)
    v = v_buf.view(-1, dim).index_select(0, head_rows).view(bs, kv_heads, max_len, dim)
    mask = None
    if bool((pool.seq_lens != max_len).any()):
        mask = (torch.arange(max_len) < pool.seq_lens.unsqueeze(1))[:, None, None, :]
    o = F.scaled_dot_product_attention(
        q.view(bs, kv_heads, num_heads // kv_heads, dim), k, v, attn_mask=mask, scale=scale
    )
    return o.reshape(bs, num_heads, dim)


def torch_extend(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, pool: Pool, ext_lens: list[int], scale: float
) -> torch.Tensor:
    out = torch.empty_like(q)
    start = 0
    for row, n, e in zip(pool.req_pool_indices.tolist(), pool.seq_lens.tolist(), ext_lens):
        slots = pool.req_to_token[row, :n].long()
        k = k_buf[slots].transpose(0, 1)
        v = v_buf[slots].transpose(0, 1)
        qi = q[start : start + e].transpose(0, 1)
        if n == e:
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            mask = torch.arange(n).unsqueeze(0) <= torch.arange(n - e, n).unsqueeze(1)
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + e] = o.transpose(0, 1)
        start += e
    return out


# ----------------------------------------------------------------------------------------------
# Cases


def bench_decode(
    shapes: Shapes, dtype: torch.dtype, bs: int, cached: int, args: argparse.Namespace
) -> Result:
    pool = make_pool(shapes, dtype, [cached] * bs)
    q = torch.randn(bs, shapes.num_heads, shapes.head_dim).to(dtype)
    scale = shapes.head_dim**-0.5
    layers = range(shapes.num_layers)

    def native() -> None:
        for i in layers:
            ops.decode_attention(
                q, pool.k[i], pool.v[i], pool.req_to_token, pool.req_pool_indices, pool.seq_lens, scale
            )

    def loop() -> None:
        for i in layers:
            torch_decode(q, pool.k[i], pool.v[i], pool, scale)

    def batched() -> None:
        head_rows = decode_head_rows(pool, shapes.num_kv_heads)
        for i in layers:
            torch_decode_batched(q, pool.k[i], pool.v[i], pool, head_rows, scale)

    ref = torch_decode(q, pool.k[0], pool.v[0], pool, scale).float()
    ref_batched = torch_decode_batched(
        q, pool.k[0], pool.v[0], pool, decode_head_rows(pool, shapes.num_kv_heads), scale
    )
    got = ops.decode_attention(
        q, pool.k[0], pool.v[0], pool.req_to_token, pool.req_pool_indices, pool.seq_lens, scale
    )
    assert torch.allclose(got.float(), ref, atol=2e-2, rtol=2e-2), "native decode disagrees with torch"
    assert torch.allclose(ref_batched.float(), ref, atol=2e-2, rtol=2e-2), "torch baselines disagree"

    t_native = time_step(native, args)
    t_loop = time_step(loop, args)
    t_batched = time_step(batched, args)
    return Result(
        "decode",
        str(dtype).removeprefix("torch."),
        bs,
        cached,
        bs,
        t_native,
        t_loop,
        t_batched,
        min(t_loop, t_batched) / t_native,
    )


def bench_extend(
    shapes: Shapes, dtype: torch.dtype, new: int, cached: int, args: argparse.Namespace, use_amx: bool = True
) -> Result:
    pool = make_pool(shapes, dtype, [cached + new])
    q = torch.randn(new, shapes.num_heads, shapes.head_dim).to(dtype)
    ext = torch.tensor([new], dtype=torch.long)
    start = torch.zeros(1, dtype=torch.long)
    scale = shapes.head_dim**-0.5
    layers = range(shapes.num_layers)

    def native() -> None:
        for i in layers:
            ops.extend_attention(
                q,
                pool.k[i],
                pool.v[i],
                pool.req_to_token,
                pool.req_pool_indices,
                pool.seq_lens,
                ext,
                start,
                scale,
                use_amx=use_amx,
            )

    def loop() -> None:
        for i in layers:
            torch_extend(q, pool.k[i], pool.v[i], pool, [new], scale)

    ref = torch_extend(q, pool.k[0], pool.v[0], pool, [new], scale).float()
    got = ops.extend_attention(
        q, pool.k[0], pool.v[0], pool.req_to_token, pool.req_pool_indices, pool.seq_lens, ext, start, scale
    )
    assert torch.allclose(got.float(), ref, atol=2e-2, rtol=2e-2), "native extend disagrees with torch"

    t_native = time_step(native, args)
    t_loop = time_step(loop, args)
    name = "extend" if use_amx else "extend, AMX off"
    return Result(
        name, str(dtype).removeprefix("torch."), 1, cached, new, t_native, t_loop, None, t_loop / t_native
    )


def bench_short_extend(
    shapes: Shapes,
    dtype: torch.dtype,
    bs: int,
    new: int,
    cached: int,
    args: argparse.Namespace,
    as_decode: bool,
) -> Result:
    """A verify step's attention: `bs` requests with `cached` tokens, `new` queries each."""
    pool = make_pool(shapes, dtype, [cached + new] * bs)
    q = torch.randn(bs * new, shapes.num_heads, shapes.head_dim).to(dtype)
    ext = torch.full((bs,), new, dtype=torch.long)
    start = torch.arange(bs, dtype=torch.long) * new
    scale = shapes.head_dim**-0.5
    layers = range(shapes.num_layers)
    kv = (pool.req_to_token, pool.req_pool_indices, pool.seq_lens, ext, start, scale)

    def native() -> None:
        for i in layers:
            ops.extend_attention(q, pool.k[i], pool.v[i], *kv, short_as_decode=as_decode)

    def loop() -> None:
        for i in layers:
            torch_extend(q, pool.k[i], pool.v[i], pool, [new] * bs, scale)

    ref = torch_extend(q, pool.k[0], pool.v[0], pool, [new] * bs, scale).float()
    got = ops.extend_attention(q, pool.k[0], pool.v[0], *kv, short_as_decode=as_decode)
    assert torch.allclose(got.float(), ref, atol=2e-2, rtol=2e-2), "native short extend disagrees with torch"
    name = "short extend" if as_decode else "short extend, extend tasks"
    t_native, t_loop = time_step(native, args), time_step(loop, args)
    return Result(
        name, str(dtype).removeprefix("torch."), bs, cached, new, t_native, t_loop, None, t_loop / t_native
    )


def bench_kv_write(shapes: Shapes, dtype: torch.dtype, tokens: int, args: argparse.Namespace) -> Result:
    num_slots = 64 * 1024
    gen = torch.Generator().manual_seed(1)
    shape = (num_slots, shapes.num_kv_heads, shapes.head_dim)
    k_bufs = [torch.zeros(shape, dtype=dtype) for _ in range(shapes.num_layers)]
    v_bufs = [torch.zeros(shape, dtype=dtype) for _ in range(shapes.num_layers)]
    loc = torch.randperm(num_slots - 1, generator=gen)[:tokens] + 1
    # K and V as views of a fused qkv projection output, as a model produces them.
    width = (shapes.num_heads + 2 * shapes.num_kv_heads) * shapes.head_dim
    qkv = torch.randn(tokens, width, generator=gen).to(dtype)
    kv_width = shapes.num_kv_heads * shapes.head_dim
    q_width = shapes.num_heads * shapes.head_dim
    k = qkv[:, q_width : q_width + kv_width].view(tokens, shapes.num_kv_heads, shapes.head_dim)
    v = qkv[:, q_width + kv_width :].view(tokens, shapes.num_kv_heads, shapes.head_dim)
    layers = range(shapes.num_layers)

    def native() -> None:
        for i in layers:
            ops.set_kv_buffer(k_bufs[i], v_bufs[i], loc, k, v)

    def index_copy() -> None:
        for i in layers:
            k_bufs[i].index_copy_(0, loc, k)
            v_bufs[i].index_copy_(0, loc, v)

    def index_put() -> None:
        for i in layers:
            k_bufs[i][loc] = k
            v_bufs[i][loc] = v

    t_native = time_step(native, args)
    t_copy = time_step(index_copy, args)
    t_put = time_step(index_put, args)
    return Result(
        "kv_write",
        str(dtype).removeprefix("torch."),
        tokens,
        0,
        tokens,
        t_native,
        t_copy,
        t_put,
        min(t_copy, t_put) / t_native,
    )


def bench_norm_rope(
    shapes: Shapes, dtype: torch.dtype, tokens: int, args: argparse.Namespace
) -> list[Result]:
    """Per step: two RMSNorms with the residual add per layer, and one rotary (q and k heads) per layer."""
    from radixengine.layers.layernorm import RMSNorm
    from radixengine.layers.rotary_embedding import get_rope

    hidden = shapes.num_heads * shapes.head_dim
    gen = torch.Generator().manual_seed(2)
    norm = RMSNorm(hidden, eps=1e-5).to(dtype)
    rope = get_rope(shapes.head_dim, shapes.head_dim, 8192, 100000.0, None, dtype)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype)
    heads = shapes.num_heads + 2 * shapes.num_kv_heads
    qkv = torch.randn(tokens, heads, shapes.head_dim, generator=gen).to(dtype)
    qk = qkv[:, : shapes.num_heads + shapes.num_kv_heads]
    positions = torch.randint(0, 8192, (tokens,), generator=gen)
    layers = range(shapes.num_layers)

    def norm_native() -> None:
        for _ in layers:
            for _ in range(2):
                ops.fused_add_rms_norm(x, residual, norm.weight.data, norm.variance_epsilon)

    def norm_torch() -> None:
        for _ in layers:
            for _ in range(2):
                norm(x, residual)

    def rope_native() -> None:
        for _ in layers:
            ops.rotary_embedding(positions, qk, rope.cos_sin_cache, shapes.head_dim)

    def rope_torch() -> None:
        rope._last = None  # the module caches cos/sin per forward: one look-up per step
        for _ in layers:
            rope(positions, qk)

    name = str(dtype).removeprefix("torch.")
    results = []
    with torch.no_grad():
        for case, native, baseline in (
            ("rmsnorm+residual", norm_native, norm_torch),
            ("rotary", rope_native, rope_torch),
        ):
            t_native = time_step(native, args)
            t_torch = time_step(baseline, args)
            results.append(Result(case, name, tokens, 0, tokens, t_native, t_torch, None, t_torch / t_native))
    return results


def print_table(results: list[Result]) -> None:
    header = "| case | dtype | batch | cached | new tokens | native ms/step | torch ms/step | torch batched ms/step | speed-up |"
    print(header)
    print("| --- " * 9 + "|")
    for r in results:
        batched = f"{r.torch_batched_ms:.2f}" if r.torch_batched_ms is not None else "–"
        print(
            f"| {r.case} | {r.dtype} | {r.batch} | {r.cached} | {r.new_tokens} | {r.native_ms:.2f} | "
            f"{r.torch_ms:.2f} | {batched} | {r.speedup:.1f}× |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="bench_results/attention_cpu.json", help="JSON results file")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--decode-batches", default="1,8,32,64")
    parser.add_argument("--cached", type=int, default=512, help="cached tokens per request in decode")
    parser.add_argument("--extend-cached", default="0,400")
    parser.add_argument("--extend-tokens", type=int, default=512)
    parser.add_argument(
        "--short-extend-cached",
        type=int,
        default=260,
        help="cached tokens per request in short_extend (8 requests)",
    )
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--min-time", type=float, default=0.5, help="seconds per measurement")
    parser.add_argument("--max-iters", type=int, default=10)
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall")
    parser.add_argument("--stat", choices=["median", "min"], default="median")
    parser.add_argument("--cases", default="decode,extend,kv_write,norm_rope")
    args = parser.parse_args()

    ops.require_native()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "thread" and torch.get_num_threads() != 1:
        parser.error("--clock thread needs --threads 1")
    shapes = Shapes(num_layers=args.layers)
    cases = set(args.cases.split(","))
    results: list[Result] = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        if "decode" in cases:
            for bs in (int(x) for x in args.decode_batches.split(",")):
                results.append(bench_decode(shapes, dtype, bs, args.cached, args))
        if "extend" in cases:
            for cached in (int(x) for x in args.extend_cached.split(",")):
                results.append(bench_extend(shapes, dtype, args.extend_tokens, cached, args))
                if dtype == torch.bfloat16 and ops.native_amx_available():  # the AMX ablation
                    results.append(
                        bench_extend(shapes, dtype, args.extend_tokens, cached, args, use_amx=False)
                    )
        if "short_extend" in cases:
            for new in (1, 3, 8):
                for as_decode in (True, False):
                    results.append(
                        bench_short_extend(shapes, dtype, 8, new, args.short_extend_cached, args, as_decode)
                    )
        if "kv_write" in cases:
            for tokens in (32, args.extend_tokens):
                results.append(bench_kv_write(shapes, dtype, tokens, args))
        if "norm_rope" in cases:
            for tokens in (1, 32, args.extend_tokens):
                results.extend(bench_norm_rope(shapes, dtype, tokens, args))

    print_table(results)
    meta = {
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "stat": args.stat,
        "load_average": os.getloadavg(),
        "isa": ops.native_isa(),
        "torch": torch.__version__,
        "shapes": asdict(shapes),
    }
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": [asdict(r) for r in results]}, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
