"""The linears of one SmolLM2-135M step on a CPU without AMX: torch's fp32 `F.linear` (MKL /
oneDNN sgemm), torch's bf16 `F.linear` (oneDNN: AVX512-BF16 products where the CPU has them,
else a slow path), the bf16 panels of `layers/bf16_linear.py` (bf16 weights widened to fp32
inside the native GEMM) with bf16 and with fp32 activations, and, where the CPU has
AVX512-BF16, the packed dot-product kernel of `layers/dpbf16_linear.py`. 30 layers of q/k/v (960 x 576),
o (576 x 576), gate/up (3072 x 576) and down (576 x 1536), each its own weights (so that, as in
the model, every weight comes from memory), plus the LM head (49152 x 576) for the decode rows;
wall time of the whole step per row count, the systems alternating within one process.

    python benchmarks/bench_bf16_linear.py --rows 1,8,32,256,1024 [--threads 1 --clock thread]
    # an AVX2 machine's view of the same CPU (the native kernels' AVX2 build, oneDNN capped):
    RADIXENGINE_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bench_bf16_linear.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from radixengine.layers.attention import native_cpu_ops
from radixengine.layers.bf16_linear import Bf16PanelWeight
from radixengine.layers.dpbf16_linear import DpBf16Weight, dpbf16_linear_unavailable_reason

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)
LM_HEAD = (49152, 576)


def step_fns(rows: int, layers: int, lm_head: bool) -> dict[str, Callable[[], None]]:
    gen = torch.Generator().manual_seed(0)
    shapes = [shape for _ in range(layers) for shape in LAYER_SHAPES] + ([LM_HEAD] if lm_head else [])
    w16 = [torch.randn(*shape, generator=gen).to(torch.bfloat16) for shape in shapes]
    w32 = [w.float() for w in w16]
    panels = [Bf16PanelWeight.pack(w) for w in w16]
    x32 = {k: torch.randn(rows, k, generator=gen) for k in {s[1] for s in shapes}}
    x16 = {k: x.to(torch.bfloat16) for k, x in x32.items()}

    def run(weights, xs, fn) -> Callable[[], None]:
        return lambda: [fn(xs[w.shape[1]] if hasattr(w, "shape") else xs[w.in_features], w) for w in weights]

    fns = {
        "fp32 F.linear": run(w32, x32, F.linear),
        "bf16 F.linear": run(w16, x16, F.linear),
        "bf16 panels, bf16 x": run(panels, x16, lambda x, w: w.linear(x)),
        "bf16 panels, fp32 x": run(panels, x32, lambda x, w: w.linear(x)),
    }
    if dpbf16_linear_unavailable_reason() is None:
        packed = [DpBf16Weight.pack(w) for w in w16]
        fns["dpbf16"] = run(packed, x16, lambda x, w: w.linear(x))
    return fns


def time_ms(fn: Callable[[], None], repeats: int, clock: Callable[[], float]) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,32,256,1024")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lm-head-rows", type=int, default=64, help="include the LM head up to this many rows")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="thread: this thread's CPU time (with --threads 1; steady on a host busy with other work)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    level = native_cpu_ops.native_level()
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "default")
    print(
        f"native level {level}; ONEDNN_MAX_CPU_ISA {onednn}; threads {torch.get_num_threads()}; clock {args.clock}"
    )
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        fns = step_fns(rows, args.layers, rows <= args.lm_head_rows)
        samples: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.rounds):  # alternate, so that a change of the host's load hits all alike
            for name, fn in fns.items():
                samples[name].append(time_ms(fn, args.repeats, clock))
        row = {"rows": rows, **{name: statistics.median(v) for name, v in samples.items()}}
        results.append(row)
        print(f"rows {rows:5d}: " + "  ".join(f"{n} {row[n]:.1f} ms" for n in fns), flush=True)
    names = list(fns)
    dp = "dpbf16" in names
    print(
        "\n| rows | "
        + " | ".join(f"{n} (ms)" for n in names)
        + " | fp32 / panels bf16 x | fp32 / panels fp32 x |"
        + (" bf16 F.linear / dpbf16 |" if dp else "")
    )
    print("| ---: | " + " | ".join("---:" for _ in names) + " | ---: | ---: |" + (" ---: |" if dp else ""))
    for row in results:
        r16 = row["fp32 F.linear"] / row["bf16 panels, bf16 x"]
        r32 = row["fp32 F.linear"] / row["bf16 panels, fp32 x"]
        cells = " | ".join(f"{row[n]:.1f}" for n in names)
        extra = f" {row['bf16 F.linear'] / row['dpbf16']:.2f}× |" if dp else ""
        print(f"| {row['rows']} | {cells} | {r16:.2f}× | {r32:.2f}× |{extra}")
    if args.out:
        meta = {
            "level": level,
            "onednn_max_cpu_isa": onednn,
            "threads": torch.get_num_threads(),
            "clock": args.clock,
        }
        with open(args.out, "w") as f:
            json.dump({"meta": {**meta, "load": os.getloadavg()}, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
