"""Multi-LoRA throughput: W1/W2 spread over 1, 4 and 16 LoRA adapters (rank 8 and 64) against the
base model alone, in one run (docs/lora.md, docs/benchmarks.md "LoRA adapters").

    python benchmarks/bench_lora.py                          # W1, W2; base, 1/4/16 adapters, rank 8 and 64
    python benchmarks/bench_lora.py --workloads W1 --ranks 8 --spreads 4 --rounds 3

For each workload: one Engine per configuration gets all 32 requests in one call (streamed, to
time the first token); request i uses adapter i mod N (N = the spread). The adapters are random
PEFT adapters of the model's shape (q/k/v/o and gate/up/down), written once to a temporary folder.
The 16-adapter runs use `--max-loras-per-batch 4` (at most 4 adapters in any batch: requests
wait for a slot), the others the default 8. With --rounds N every configuration runs N times,
the base model first in each round. Reported (medians over the rounds): output tokens/s, the
ratio to the same round's base model run (and its range), time to first token, the prompt
tokens found in the radix cache (each adapter's KV is its own: W1's shared system prompt is
computed once per adapter), and how many of the requests finished."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
WORKLOADS_DIR = REPO.parent / "shared" / "workloads"
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, config, rank: int, seed: int) -> str:
    """A random PEFT LoRA adapter of `rank` over a Llama-shaped model of `config`."""
    from safetensors.torch import save_file

    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (fan_in, fan_out) in shapes.items():
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * fan_in**-0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    lora_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES),
                   "bias": "none", "lora_dropout": 0.0}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(lora_config))
    return str(folder)


async def _run_requests(engine, items: list[dict], names: list[str | None]):
    start = time.perf_counter()

    async def one(item: dict, name: str | None):
        first, meta = None, None
        stream = await engine.async_generate(
            messages=item["messages"], sampling_params=item["sampling_params"], stream=True, lora_path=name
        )
        async for chunk in stream:
            if first is None and chunk["output_ids"]:
                first = time.perf_counter() - start
            meta = chunk["meta_info"]
        return first, meta

    results = await asyncio.gather(*(one(item, name) for item, name in zip(items, names)))
    return time.perf_counter() - start, results


def run_config(items, model_path, dtype, threads, adapters: dict[str, str], max_loras_per_batch: int) -> dict:
    from radixengine import Engine

    lora = {}
    if adapters:
        lora = dict(
            lora_paths=[f"{n}={p}" for n, p in adapters.items()],
            max_loras_per_batch=max_loras_per_batch,
        )
    names = (
        [None] * len(items)
        if not adapters
        else [list(adapters)[i % len(adapters)] for i in range(len(items))]
    )
    with Engine(
        model_path=model_path, dtype=dtype, num_threads=threads, log_level="warning", **lora
    ) as engine:
        engine.generate("Warm-up.", {"max_new_tokens": 8, "temperature": 0}, lora_path=names[0])
        engine.flush_cache()
        elapsed, results = asyncio.run(_run_requests(engine, items, names))
    ttfts = [r[0] for r in results if r[0] is not None]
    finished = sum(
        1 for r in results if r[1] and r[1]["finish_reason"] and r[1]["finish_reason"]["type"] != "abort"
    )
    completion = sum(r[1]["completion_tokens"] for r in results if r[1])
    prompt = sum(r[1]["prompt_tokens"] for r in results if r[1])
    cached = sum(r[1]["cached_tokens"] for r in results if r[1])
    return {
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "elapsed_s": elapsed,
        "output_tokens": completion,
        "output_tok_s": completion / elapsed,
        "ttft_mean_s": statistics.mean(ttfts) if ttfts else None,
        "finished": finished,
        "requests": len(items),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the bundled SmolLM2 GGUF")
    p.add_argument("--workloads-dir", default=str(WORKLOADS_DIR))
    p.add_argument("--workloads", default="W1,W2")
    p.add_argument("--spreads", default="1,4,16", help="adapters the requests are spread over")
    p.add_argument("--ranks", default="8,64")
    p.add_argument(
        "--dtype", default="auto", help="the engine's (auto: bfloat16 where the CPU has bf16 products)"
    )
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the workload's (64)")
    p.add_argument(
        "--rounds", type=int, default=1,
        help="run every configuration this many times, base first in each round; the ratio is each round's "
        "against that round's base, and the table shows the medians",
    )  # fmt: skip
    p.add_argument("--output", default=str(REPO / "bench_results" / "bench_lora.json"))
    args = p.parse_args(argv)

    from radixengine.model_loader import ModelConfig, default_model_path

    model_path = args.model_path or default_model_path()
    config = ModelConfig(model_path, None, args.dtype, "cpu").hf_config
    spreads = [int(x) for x in args.spreads.split(",")]
    ranks = [int(x) for x in args.ranks.split(",")]
    folder = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    rows = []
    try:
        pool = {
            r: [write_adapter(folder / f"r{r}-{i}", config, r, seed=i) for i in range(max(spreads))]
            for r in ranks
        }
        configs = [(0, None)] + [(n, rank) for rank in ranks for n in spreads]
        for workload in args.workloads.split(","):
            items = _load_workload(Path(args.workloads_dir) / f"{workload}.jsonl", args.max_new_tokens)
            runs: dict[tuple[int, int | None], list[dict]] = {c: [] for c in configs}
            for _ in range(args.rounds):
                for n, rank in configs:
                    adapters = {f"lora{i}": pool[rank][i] for i in range(n)} if n else {}
                    out = run_config(items, model_path, args.dtype, args.threads, adapters, 4 if n > 8 else 8)
                    out["x_base"] = out["output_tok_s"] / runs[(0, None)][-1]["output_tok_s"] if n else 1.0
                    runs[(n, rank)].append(out)
            for n, rank in configs:
                rows.append(_row(workload, n, rank, runs[(n, rank)]))
                _print(rows[-1])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    meta = {"model_path": model_path, "dtype": args.dtype, "threads": args.threads, "cpu": _cpu_name(),
            "rounds": args.rounds}  # fmt: skip
    Path(args.output).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.output}")


def _load_workload(path: Path, max_new_tokens: int | None) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        items = [json.loads(line) for line in f if line.strip()]
    if max_new_tokens:
        for item in items:
            item["sampling_params"] = {**item["sampling_params"], "max_new_tokens": max_new_tokens}
    return items


def _row(workload: str, n: int, rank: int | None, runs: list[dict]) -> dict:
    """The configuration's medians over its rounds (and every round's numbers)."""
    median = {k: statistics.median(r[k] for r in runs) for k in ("output_tok_s", "x_base", "ttft_mean_s")}
    return {
        "workload": workload,
        "adapters": n,
        "rank": rank,
        "max_loras_per_batch": (4 if n > 8 else 8) if n else None,
        **runs[0],
        **median,
        "x_base_rounds": [r["x_base"] for r in runs],
        "finished": min(r["finished"] for r in runs),
        "rounds": runs,
    }


def _print(row: dict) -> None:
    label = (
        "base model"
        if not row["adapters"]
        else f"{row['adapters']} adapters, rank {row['rank']}, per batch {row['max_loras_per_batch']}"
    )
    spread = "–".join(f"{x:.2f}" for x in (min(row["x_base_rounds"]), max(row["x_base_rounds"])))
    print(
        f"| {row['workload']} | {label} | {row['output_tok_s']:.1f} | {row['x_base']:.2f} ({spread}) "
        f"| {row['ttft_mean_s']:.2f} | {row['cache_hit_rate']:.1%} | {row['finished']}/{row['requests']} |",
        flush=True,
    )


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
