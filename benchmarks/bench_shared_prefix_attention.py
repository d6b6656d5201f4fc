"""Shared-prefix (cascade) decode attention against the plain decode kernel, on SmolLM2-135M's
attention shapes (9 query heads, 3 kv heads, head_dim 64), one step = 30 layers each with its own
K/V buffers. The shared blocks' slots are contiguous (one prefill wrote them), each request's own
slots too; the plan is built once per step and counted in the step. "own keys only" is the plain
kernel over each request's own keys alone (no prefix at all): the work every shared-prefix pass
still has, so plain / own-only bounds its speed-up.

  W1       32 requests, one 420-token prefix, 60 own tokens each
  tree     4 prefixes x 8 requests, 420 + 60
  3-level  a 200-token system prompt (all 32), 150-token few-shot blocks (2 x 16), 80-token
           histories (8 x 4), 50 own tokens
  long     8 requests, one 2000-token prefix, 100 own
  none     32 requests of 480 tokens sharing nothing (the plan finds nothing: plain kernel)

    .venv/bin/python benchmarks/bench_shared_prefix_attention.py --threads 1 --clock thread
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from radixengine.layers.attention import native_cpu_ops as ops
from radixengine.layers.attention.cascade_plan import build_cascade_plan

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64

# name -> (levels [(length, group size)], own tokens, batch)
CASES: dict[str, tuple[list[tuple[int, int]], int, int]] = {
    "W1": ([(420, 32)], 60, 32),
    "tree": ([(420, 8)], 60, 32),
    "3-level": ([(200, 32), (150, 16), (80, 4)], 50, 32),
    "long": ([(2000, 8)], 100, 8),
    "none": ([], 480, 32),
}


@dataclass
class Row:
    case: str
    dtype: str
    batch: int
    tokens_per_request: int
    shared_tokens: int  # key reads the plan saves per layer
    plain_ms: float
    cascade_ms: float
    cascade_fp32_products_ms: float
    own_only_ms: float  # the plain kernel over each request's own keys alone
    speedup: float  # plain / cascade
    bound: float  # plain / own_only: the speed-up of a free shared part


def build_rows(levels: list[tuple[int, int]], own: int, batch: int) -> list[list[int]]:
    next_slot = 1
    rows: list[list[int]] = [[] for _ in range(batch)]
    for length, group in levels:
        for first in range(0, batch, group):
            block = list(range(next_slot, next_slot + length))
            next_slot += length
            for b in range(first, first + group):
                rows[b] += block
    for row in rows:
        row += list(range(next_slot, next_slot + own))
        next_slot += own
    return rows


def time_step(fn, args) -> float:
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    fn()
    times = []
    for _ in range(args.repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times) * 1e3


def bench_case(name: str, dtype: torch.dtype, args) -> Row:
    levels, own, batch = CASES[name]
    rows = build_rows(levels, own, batch)
    lens = [len(r) + 1 for r in rows]  # + the new token
    num_slots = max(max(r) for r in rows) + batch + 2
    table = torch.zeros(batch, max(lens) + 8, dtype=torch.int32)
    for b, row in enumerate(rows):
        table[b, : len(row) + 1] = torch.tensor(row + [num_slots - 1 - b], dtype=torch.int32)
    idx, seq = torch.arange(batch), torch.tensor(lens)
    gen = torch.Generator().manual_seed(0)
    kv = [
        tuple(torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in "kv")
        for _ in range(args.layers)
    ]
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
    scale = HEAD_DIM**-0.5

    def plain() -> None:
        for k, v in kv:
            ops.decode_attention(q, k, v, table, idx, seq, scale)

    def cascade(use_amx: bool):
        def step() -> None:
            plan = build_cascade_plan(table, idx, lens, num_threads=torch.get_num_threads())
            for k, v in kv:
                if plan is None:
                    ops.decode_attention(q, k, v, table, idx, seq, scale)
                else:
                    ops.decode_attention_cascade(
                        q, k, v, table, idx, seq, scale, *plan.kernel_args(), use_amx=use_amx
                    )

        return step

    own_table = torch.zeros_like(table)
    for b, row in enumerate(rows):
        own_slots = row[len(row) - own :] + [num_slots - 1 - b]
        own_table[b, : len(own_slots)] = torch.tensor(own_slots, dtype=torch.int32)
    own_seq = torch.full((batch,), own + 1)

    def own_only() -> None:
        for k, v in kv:
            ops.decode_attention(q, k, v, own_table, idx, own_seq, scale)

    plan = build_cascade_plan(table, idx, lens, num_threads=torch.get_num_threads())
    plain_ms = time_step(plain, args)
    cascade_ms = time_step(cascade(True), args)
    fp32_ms = time_step(cascade(False), args)
    own_ms = time_step(own_only, args)
    return Row(
        name,
        str(dtype).removeprefix("torch."),
        batch,
        lens[0],
        plan.shared_tokens if plan is not None else 0,
        plain_ms,
        cascade_ms,
        fp32_ms,
        own_ms,
        plain_ms / cascade_ms,
        plain_ms / own_ms,
    )


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument(
        "--clock", choices=["wall", "thread"], default="wall", help="thread: CPU time of this thread"
    )
    p.add_argument("--out", default="bench_results/shared_prefix_attention.json")
    args = p.parse_args()
    ops.require_native()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = [
        bench_case(name, getattr(torch, dtype), args)
        for dtype in args.dtypes.split(",")
        for name in args.cases.split(",")
    ]
    print(
        "| case | dtype | batch | tokens/request | shared key reads saved / layer | plain ms | cascade ms | cascade, fp32 products ms | own keys only ms | speed-up | bound |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r.case} | {r.dtype} | {r.batch} | {r.tokens_per_request} | {r.shared_tokens} | {r.plain_ms:.2f} | "
              f"{r.cascade_ms:.2f} | {r.cascade_fp32_products_ms:.2f} | {r.own_only_ms:.2f} | {r.speedup:.2f}× | {r.bound:.2f}× |")  # fmt: skip
    meta = {
        "cpu": cpu_name(),
        "amx": ops.native_module_with("amx_available") is not None
        and ops.native_module_with("amx_available").amx_available(),
        "isa": ops.native_isa(),
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "load_average": os.getloadavg(),
    }
    print(json.dumps(meta))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=2))


if __name__ == "__main__":
    main()
