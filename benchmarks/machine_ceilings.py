"""What this machine's CPU can do at most, as yardsticks for the kernels' numbers: memory read
bandwidth (a `sum` over a tensor far larger than the caches) and fp32 matmul throughput (a square
sgemm through torch/MKL), each with 1 thread and with all cores.

    python benchmarks/machine_ceilings.py --out bench_results/machine_ceilings.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import torch


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (page faults, thread pool start)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(threads: int, read_gb: float, gemm_n: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    x = torch.ones(int(read_gb * 2**30) // 4)
    read = best_seconds(lambda: x.sum(), repeats)
    a, b = torch.randn(gemm_n, gemm_n), torch.randn(gemm_n, gemm_n)
    gemm = best_seconds(lambda: a @ b, repeats)
    return {
        "threads": threads,
        "read_gb_per_s": x.numel() * 4 / read / 1e9,
        "sgemm_gflop_per_s": 2 * gemm_n**3 / gemm / 1e9,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--read-gb", type=float, default=1.0, help="GiB summed for the bandwidth")
    p.add_argument("--gemm-n", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5, help="the best of these runs counts")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cores = os.cpu_count() or 1
    rows = [measure(t, args.read_gb, args.gemm_n, args.repeats) for t in sorted({1, cores})]
    for r in rows:
        print(
            f"{r['threads']} thread(s): read {r['read_gb_per_s']:.1f} GB/s, sgemm {args.gemm_n}^3 "
            f"{r['sgemm_gflop_per_s']:.1f} GFLOP/s"
        )
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "load_average": os.getloadavg(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
