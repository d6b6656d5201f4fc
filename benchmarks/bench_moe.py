"""A decode step of a small random Qwen3-MoE (dummy weights) with each path of the routed
experts: the native grouped kernel, the grouped torch path (padded torch.bmm) and the per-expert
Python loop transformers runs (`radixengine/layers/moe_experts.py`).

Model: hidden 1024, 6 layers (16 heads, 4 KV heads, head_dim 64), 64 experts of intermediate
size 256 with top-8 routing (the expert-to-hidden ratios of Qwen3-30B-A3B, scaled down), vocab
8192, float32, each request with 128 cached tokens. The paths alternate round by round so that
load from other processes falls on all alike; the table gives the median step (and the minimum
in the JSON), in ms.

    python benchmarks/bench_moe.py --out bench_results/moe.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_forward import OurModel, _cpu_name  # noqa: E402

from radixengine.layers import moe, moe_experts  # noqa: E402

CONFIG = dict(
    hidden_size=1024,
    intermediate_size=2048,
    moe_intermediate_size=256,
    num_experts=64,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    num_hidden_layers=6,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=8192,
    max_position_embeddings=4096,
)
PATHS = {
    "native": moe_experts.fused_experts_native,
    "grouped": moe_experts.fused_experts_grouped,
    "naive": moe_experts.fused_experts_naive,
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--cached-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=4, help="timed decode steps per round")
    p.add_argument("--repeats", type=int, default=3, help="rounds, the paths alternating")
    p.add_argument("--threads", type=int, default=None, help="default: torch's default")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args()


def write_config(folder: str) -> None:
    import transformers

    config = transformers.Qwen3MoeConfig(**CONFIG)
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(folder)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    paths = {k: v for k, v in PATHS.items() if k != "native" or moe_experts.moe_native_available()}
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        write_config(folder)
        run_args = argparse.Namespace(
            model_path=folder,
            cached_len=args.cached_len,
            decode_steps=args.decode_steps,
            prefill_len=0,
            attention_backend="torch_native",
            threads=args.threads,
            load_format="dummy",
            kv_cache_dtype="auto",
        )
        model = OurModel(run_args, "float32", max(batch_sizes))
        times: dict[tuple[int, str], list[float]] = {(bs, p): [] for bs in batch_sizes for p in paths}
        for _ in range(args.repeats):
            for bs in batch_sizes:
                for name, fn in paths.items():
                    moe.fused_experts = fn  # what FusedMoEExperts.forward calls
                    times[bs, name] += model.decode(
                        bs, args.cached_len, args.decode_steps, CONFIG["vocab_size"]
                    )
    rows = [
        {
            "batch_size": bs,
            "path": name,
            "median_ms": statistics.median(t) * 1e3,
            "min_ms": min(t) * 1e3,
            "steps": len(t),
        }
        for (bs, name), t in times.items()
    ]
    result = {
        "model": CONFIG,
        "dtype": "float32",
        "cpu": _cpu_name(),
        "threads": torch.get_num_threads(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "torch": torch.__version__,
        "rows": rows,
    }
    print(
        f"{result['cpu']}, {result['threads']} threads, load average {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    print("batch | " + " | ".join(f"{p} ms" for p in paths) + " | naive / best grouped")
    for bs in batch_sizes:
        med = {r["path"]: r["median_ms"] for r in rows if r["batch_size"] == bs}
        best = min(v for k, v in med.items() if k != "naive")
        print(f"{bs:5d} | " + " | ".join(f"{med[p]:8.2f}" for p in paths) + f" | {med['naive'] / best:.2f}x")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
