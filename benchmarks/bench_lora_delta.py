"""The LoRA delta's forms on one layer of SmolLM2-135M's shapes (q/k/v, o, gate/up, down), ms per
layer: the native kernel (`lora_delta`), the torch form `apply_lora_delta` takes without it (runs,
or masked up to 256 rows) and the per-slot gathers (docs/lora.md, "The delta").

    python benchmarks/bench_lora_delta.py                 # ranks 8 and 64; 64, 256, 2048 rows
    python benchmarks/bench_lora_delta.py --threads 1 --ranks 8
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path

import torch

from radixengine.layers.attention import native_cpu_ops
from radixengine.layers.native_small_ops import native_small_ops
from radixengine.lora.lora_backend import apply_lora_delta, gathered_delta
from radixengine.lora.lora_batch_info import LoRABatchInfo

REPO = Path(__file__).resolve().parent.parent
MODULES = {
    "qkv": (576, (576, 192, 192)),
    "o": (576, (576,)),
    "gate_up": (576, (1536, 1536)),
    "down": (1536, (576,)),
}
SLOTS = 8


def time_ms(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def layer_times(rank: int, rows: int, adapters: int, requests: int, dtype: torch.dtype) -> dict[str, float]:
    slots = [i % adapters + 1 for i in range(requests)]
    info = LoRABatchInfo.build(
        slots, [rows // requests] * requests, dict.fromkeys(set(slots), rank), torch.device("cpu")
    )
    native = native_cpu_ops.require_native()
    repeats = 3 if rows > 512 else 20
    totals = {"native": 0.0, "torch": 0.0, "gathered": 0.0}
    for fan_in, pieces in MODULES.values():
        a = (torch.randn(SLOTS + 1, rank, len(pieces), fan_in) * 0.05).to(dtype)
        b = (torch.randn(SLOTS + 1, rank, len(pieces), sum(pieces)) * 0.05).to(dtype)
        x, y = torch.randn(rows, fan_in).to(dtype), torch.randn(rows, sum(pieces)).to(dtype)
        forms = {
            "native": partial(native.lora_delta, y, x, a, b, info.row_slot, info.rank_of_slot, list(pieces)),
            "torch": partial(apply_lora_delta, x, y, a, b, info, pieces),
            "gathered": partial(gathered_delta, x, y, a, b, info),
        }
        with native_small_ops(False):
            for name, form in forms.items():
                totals[name] += time_ms(form, repeats)
    return totals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="8,64")
    p.add_argument("--rows", default="64,256,2048")
    p.add_argument("--adapters", type=int, default=4, help="interleaved over 32 requests (64 for 64 rows)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--output", default=str(REPO / "bench_results" / "bench_lora_delta.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    print("| rank | rows | native ms | torch form ms | gathered ms |\n|---:|---:|---:|---:|---:|")
    for rank in map(int, args.ranks.split(",")):
        for rows in map(int, args.rows.split(",")):
            t = layer_times(
                rank, rows, args.adapters, min(rows, 32) if rows > 64 else rows, getattr(torch, args.dtype)
            )
            results.append({"rank": rank, "rows": rows, "adapters": args.adapters, **t})
            print(
                f"| {rank} | {rows} | {t['native']:.2f} | {t['torch']:.2f} | {t['gathered']:.2f} |",
                flush=True,
            )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(
        json.dumps({"threads": args.threads, "dtype": args.dtype, "results": results}, indent=1)
    )


if __name__ == "__main__":
    main()
