"""bf16 linears of one decode step on AMX tiles (`layers/amx_linear.py`) against torch's
`F.linear` (oneDNN) and oneDNN with its weights packed ahead (`torch.ops.mkldnn`), on
SmolLM2-135M's shapes: 30 layers of q/k/v (960 x 576), o (576 x 576), gate/up (3072 x 576) and
down (576 x 1536), each layer its own weights (so that, as in the model, every weight comes from
memory), plus the LM head (49152 x 576); wall time of the whole step per row count.

    python benchmarks/bench_amx_linear.py --rows 1,8,32,256 --out bench_results/amx_linear.json
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

from radixengine.layers.amx_linear import AmxWeight, amx_linear_unavailable_reason

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)
LM_HEAD = (49152, 576)


def step_fns(rows: int, layers: int) -> dict[str, Callable[[], None]]:
    gen = torch.Generator().manual_seed(0)
    weights = [
        torch.randn(*shape, generator=gen).to(torch.bfloat16) for _ in range(layers) for shape in LAYER_SHAPES
    ]
    weights.append(torch.randn(*LM_HEAD, generator=gen).to(torch.bfloat16))
    xs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for k in {w.shape[1] for w in weights}}
    # Packed for max(rows, 4): packed for 1 row, oneDNN's LM head takes ~0.4 s a call here.
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, max(rows, 4)) for w in weights]
    amx = [AmxWeight.pack(w) for w in weights] if amx_linear_unavailable_reason() is None else []

    def plain() -> None:
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    def packed_onednn() -> None:
        for w, p in zip(weights, onednn):
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

    def packed_amx() -> None:
        for w in amx:
            w.linear(xs[w.in_features])

    fns = {"F.linear": plain, "oneDNN packed": packed_onednn}
    if amx:
        fns["AMX tiles"] = packed_amx
    return fns


def time_ms(fn: Callable[[], None], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,32,256")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"AMX: {amx_linear_unavailable_reason() or 'available'}; threads {torch.get_num_threads()}")
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        fns = step_fns(rows, args.layers)
        # The systems alternate, so that a change of the host's load hits all of them alike.
        samples: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(3):
            for name, fn in fns.items():
                samples[name].append(time_ms(fn, args.repeats))
        row = {"rows": rows, **{name: statistics.median(v) for name, v in samples.items()}}
        results.append(row)
        cells = "  ".join(f"{name} {row[name]:.1f} ms" for name in fns)
        print(f"rows {rows:4d}: {cells}")
    print("\n| rows | " + " | ".join(f"{n} (ms)" for n in fns) + " | F.linear / AMX |")
    print("| ---: | " + " | ".join("---:" for _ in fns) + " | ---: |")
    for row in results:
        ratio = f"{row['F.linear'] / row['AMX tiles']:.2f}×" if "AMX tiles" in row else "–"
        print(f"| {row['rows']} | " + " | ".join(f"{row[n]:.1f}" for n in fns) + f" | {ratio} |")
    if args.out:
        meta = {"cpu": _cpu_name(), "threads": torch.get_num_threads(), "load": os.getloadavg()}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


def _cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
