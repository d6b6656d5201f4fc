"""Offline throughput: radixengine's Engine against transformers' batched `generate` (and,
optionally, llama-cpp-python) on the shared workloads, in one run.

    python benchmarks/bench_offline.py                                  # W1, W2; fcfs, lpm, dfs-weight; bf16 + fp32
    python benchmarks/bench_offline.py --workloads W1 --dtypes bfloat16 --policies lpm
    python benchmarks/bench_offline.py --peers transformers,llamacpp    # llama-cpp-python must be installed
    python benchmarks/bench_offline.py --policies lpm --overlap on,off  # overlap loop on vs off, same run
    python benchmarks/bench_offline.py --dtypes float32 --kv-cache-dtypes auto,float16  # 16-bit KV cache too
    python benchmarks/bench_offline.py --shared-prefix on,off     # shared-prefix attention on vs off
    python benchmarks/bench_offline.py --workloads W3             # the prefix tree (benchmarks/workloads)
    python benchmarks/bench_offline.py --device cuda --dtypes bfloat16 --policies lpm      # both on one GPU
    python benchmarks/bench_offline.py --model-path DIR --random-weights   # DIR: config + tokenizer only

For each dtype and workload: one Engine per policy gets all 32 requests in one call (streamed, to
time the first token of each); transformers runs the same prompts as one left-padded batch of 32
at the same dtype and thread count, on the same `--device`. Reported: output tokens/s, the ratio to transformers, time to
first token (mean, p50, max), and the cache hit rate against the ideal (every token of a prompt
that an earlier prompt of the batch already has, at least one token recomputed per prompt).
`--overlap on,off` runs each policy with the overlap schedule on and off (`disable_overlap_schedule`);
on a CPU, `--cpu-forward-stream` decides whether "on" really overlaps (the JSON's
`overlap_step_order`). `--kv-cache-dtypes auto,float16` adds runs with a 16-bit KV cache; their
`same_tokens_as_exact` counts the requests whose greedy tokens equal the exact (auto) run's.
`--shared-prefix on,off` adds runs with `disable_shared_prefix_attention`; their
`same_tokens_as_shared_on` counts the requests whose greedy tokens equal the run with it on.
`--random-weights` (a machine without the model's weights): seeded random weights of the model's
shape, saved once so that the engine and transformers load the same; the prompts and their shared
prefixes are the workloads', the outputs run to their max_new_tokens (no real EOS)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from radixengine.server_args import CPU_FORWARD_STREAMS, KV_CACHE_DTYPES

REPO = Path(__file__).resolve().parent.parent
WORKLOADS_DIR = REPO.parent / "shared" / "workloads"
OWN_WORKLOADS_DIR = REPO / "benchmarks" / "workloads"
DTYPE_NAMES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def workload_path(name: str, workloads_dir: str) -> Path:
    """`name`.jsonl in --workloads-dir (W1, W2), else among the benchmarks' own (W3, the prefix
    tree of make_tree_workload.py)."""
    path = Path(workloads_dir) / f"{name}.jsonl"
    return path if path.exists() else OWN_WORKLOADS_DIR / f"{name}.jsonl"


def load_workload(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def prompt_ids(tokenizer, items: list[dict]) -> list[list[int]]:
    out = []
    for item in items:
        if "messages" in item:
            text = tokenizer.apply_chat_template(item["messages"], add_generation_prompt=True, tokenize=False)
            out.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            out.append(tokenizer.encode(item["text"]))
    return out


def ideal_cached_tokens(prompts: list[list[int]]) -> int:
    """Tokens of each prompt already present in an earlier one (trie), at most len - 1 each."""
    root: dict = {}
    total = 0
    for ids in prompts:
        node, shared = root, 0
        for t in ids:
            if t not in node:
                break
            node, shared = node[t], shared + 1
        total += min(shared, len(ids) - 1)
        node = root
        for t in ids:
            node = node.setdefault(t, {})
    return total


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


# radixengine ----------------------------------------------------------------------------------


async def _run_requests(engine, items: list[dict]) -> tuple[float, list[float], list[dict], list[list[int]]]:
    start = time.perf_counter()

    async def one(item: dict) -> tuple[float, dict, list[int]]:
        first, meta, ids = None, None, []
        stream = await engine.async_generate(
            messages=item.get("messages"),
            prompt=item.get("text"),
            sampling_params=item["sampling_params"],
            stream=True,
        )
        async for chunk in stream:
            if first is None and chunk["output_ids"]:
                first = time.perf_counter() - start
            meta = chunk["meta_info"]
            ids += chunk["output_ids"]
        return first, meta, ids

    results = await asyncio.gather(*(one(item) for item in items))
    elapsed = time.perf_counter() - start
    return elapsed, [r[0] for r in results], [r[1] for r in results], [r[2] for r in results]


@dataclass
class EngineConfig:
    policy: str
    overlap: bool
    cpu_forward_stream: str
    kv_cache_dtype: str = "auto"
    shared_prefix: bool = True

    def label(self, ablation: bool) -> str:
        label = f"radixengine {self.policy}" + (
            f", overlap {'on' if self.overlap else 'off'}" if ablation else ""
        )
        if not self.shared_prefix:
            label += ", shared-prefix attention off"
        return label if self.kv_cache_dtype == "auto" else f"{label}, KV {DTYPE_NAMES[self.kv_cache_dtype]}"


def run_radixengine(
    items: list[dict],
    config: EngineConfig,
    dtype: str,
    threads: int,
    model_path: str | None,
    quantization: str = "auto",
    device: str = "cpu",
) -> dict:
    from radixengine import Engine

    with Engine(
        model_path=model_path,
        device=device,
        schedule_policy=config.policy,
        dtype=dtype,
        num_threads=threads,
        log_level="warning",
        disable_overlap_schedule=not config.overlap,
        cpu_forward_stream=config.cpu_forward_stream,
        kv_cache_dtype=config.kv_cache_dtype,
        quantization=quantization,
        disable_shared_prefix_attention=not config.shared_prefix,
    ) as engine:
        engine.generate("Warm-up.", {"max_new_tokens": 8, "temperature": 0})
        engine.flush_cache()
        elapsed, ttfts, metas, output_ids = asyncio.run(_run_requests(engine, items))
        info = engine.get_server_info()
    completion = sum(m["completion_tokens"] for m in metas)
    prompt = sum(m["prompt_tokens"] for m in metas)
    cached = sum(m["cached_tokens"] for m in metas)
    return {
        "policy": config.policy,
        "overlap": config.overlap,
        "cpu_forward_stream": config.cpu_forward_stream,
        "kv_cache_dtype": config.kv_cache_dtype,
        "shared_prefix_attention": config.shared_prefix,
        "output_ids": output_ids,
        "overlap_step_order": config.overlap and _overlaps(config.cpu_forward_stream, threads, info),
        "elapsed_s": elapsed,
        "output_tokens": completion,
        "output_tok_s": completion / elapsed,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "ttft_mean_s": statistics.mean(ttfts),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_max_s": max(ttfts),
        "num_prefill_tokens": info.get("num_prefill_tokens"),
        "num_retracted_reqs": info.get("num_retracted_reqs"),
        "num_forward_steps": info.get("num_forward_steps"),
    }


def _overlaps(cpu_forward_stream: str, threads: int, info: dict) -> bool:
    """Whether the engine's overlap loop really overlaps: always on a GPU; on a CPU only when the
    forward runs on a worker thread."""
    from radixengine.utils.streams import resolve_cpu_layout

    return info.get("device") != "cpu" or resolve_cpu_layout(cpu_forward_stream, threads) == "thread"


# transformers ---------------------------------------------------------------------------------


def run_transformers(
    prompts: list[list[int]], max_new_tokens: int, dtype: str, threads: int, hf_path: str, device: str = "cpu"
) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(hf_path)
    model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=getattr(torch, dtype)).to(device).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    kwargs = {"do_sample": False, "pad_token_id": pad}
    with torch.inference_mode():
        model.generate(input_ids[:2, -16:], attention_mask=mask[:2, -16:], max_new_tokens=4, **kwargs)
        start = time.perf_counter()
        out = model.generate(
            input_ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            **kwargs,
        )
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    tokens = (out.shape[1] - width) * len(prompts)
    del model
    gc.collect()
    return {
        "system": "transformers",
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "output_tok_s": tokens / elapsed,
    }


# llama-cpp-python -----------------------------------------------------------------------------


def run_llamacpp(prompts: list[list[int]], max_new_tokens: int, threads: int, gguf_path: str) -> dict:
    """Requests one after another; llama-cpp-python reuses the longest common prefix with the
    previous prompt's KV. Extra buffer types (the AMX repack path) are turned off: on this CPU
    they crash at the first decode (llama.cpp #20824)."""
    import llama_cpp.llama_cpp as lib
    from llama_cpp import Llama

    default_params = lib.llama_model_default_params

    def params_without_extra_bufts():
        params = default_params()
        if hasattr(params, "use_extra_bufts"):
            params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = params_without_extra_bufts
    llm = Llama(model_path=gguf_path, n_ctx=4096, n_threads=threads, n_batch=512, verbose=False)
    start = time.perf_counter()
    ttfts, tokens = [], 0
    for ids in prompts:
        t0 = time.perf_counter()
        for i, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1, reset=True)):
            if i == 0:
                ttfts.append(time.perf_counter() - t0)
            tokens += 1
            if i + 1 >= max_new_tokens:
                break
    elapsed = time.perf_counter() - start
    return {
        "system": "llama-cpp-python (sequential, prefix reuse)",
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "output_tok_s": tokens / elapsed,
        "ttft_mean_s": statistics.mean(ttfts),
    }


# Main -----------------------------------------------------------------------------------------

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".index.json", ".done")


def random_weights_folder(shape_path: str, root: Path, seed: int = 0) -> str:
    """`shape_path`'s config and tokenizer beside seeded random weights of its shape."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = root / "random_weights"
    folder.mkdir(parents=True, exist_ok=True)
    for f in Path(shape_path).iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy(f, folder / f.name)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape_path)).save_pretrained(folder)
    return str(folder)


def bench_workload(name: str, items: list[dict], dtype: str, args, hf_path: str, tokenizer) -> list[dict]:
    prompts = prompt_ids(tokenizer, items)
    max_new = max(item["sampling_params"].get("max_new_tokens", 128) for item in items)
    ideal = ideal_cached_tokens(prompts)
    rows = []
    ablation = args.overlap != ["on"]
    for policy in args.policies:
        for overlap in args.overlap:
            for kv_dtype in args.kv_cache_dtypes:
                for shared in args.shared_prefix:
                    config = EngineConfig(
                        policy, overlap == "on", args.cpu_forward_stream, kv_dtype, shared == "on"
                    )
                    print(f"[{name} {dtype}] {config.label(ablation)} ...", file=sys.stderr, flush=True)
                    row = {"system": config.label(ablation)}
                    row.update(
                        run_radixengine(
                            items,
                            config,
                            dtype,
                            args.threads,
                            args.model_path,
                            args.quantization,
                            args.device,
                        )
                    )
                    rows.append(row)
    exact = next((r["output_ids"] for r in rows if r["kv_cache_dtype"] == "auto"), None)
    shared_on = next((r["output_ids"] for r in rows if r["shared_prefix_attention"]), None)
    for row in rows:
        if shared_on is not None and not row["shared_prefix_attention"]:
            row["same_tokens_as_shared_on"] = sum(a == b for a, b in zip(row["output_ids"], shared_on))
        row["ideal_cached_tokens"] = ideal
        row["cached_vs_ideal"] = row["cached_tokens"] / ideal if ideal else None
        if exact is not None and row["kv_cache_dtype"] != "auto":
            row["same_tokens_as_exact"] = sum(a == b for a, b in zip(row["output_ids"], exact))
    if "transformers" in args.peers:
        print(f"[{name} {dtype}] transformers ...", file=sys.stderr, flush=True)
        rows.append(run_transformers(prompts, max_new, dtype, args.threads, hf_path, args.device))
    if "llamacpp" in args.peers and dtype == args.dtypes[0]:
        print(f"[{name}] llama-cpp-python ...", file=sys.stderr, flush=True)
        rows.append(run_llamacpp(prompts, max_new, args.threads, args.gguf_path))
    hf = next((r for r in rows if r["system"] == "transformers"), None)
    for r in rows:
        r.update(workload=name, dtype=dtype)
        r["ratio_vs_transformers"] = r["output_tok_s"] / hf["output_tok_s"] if hf else None
    return rows


def print_table(rows: list[dict]) -> None:
    header = "| workload | dtype | system | output tok/s | × transformers | TTFT mean / max (s) | cache hit | cached / ideal |"
    print(header)
    print("|" + "---|" * 8)
    for r in rows:
        ttft = (
            f"{r['ttft_mean_s']:.2f} / {r.get('ttft_max_s', float('nan')):.2f}" if "ttft_mean_s" in r else "–"
        )
        hit = f"{r['cache_hit_rate']:.1%}" if "cache_hit_rate" in r else "–"
        ideal = f"{r['cached_vs_ideal']:.1%}" if r.get("cached_vs_ideal") is not None else "–"
        ratio = f"{r['ratio_vs_transformers']:.2f}" if r.get("ratio_vs_transformers") else "–"
        system = r["system"]
        if "same_tokens_as_exact" in r:
            system += f" ({r['same_tokens_as_exact']}/{len(r['output_ids'])} outputs = exact)"
        if "same_tokens_as_shared_on" in r:
            system += f" ({r['same_tokens_as_shared_on']}/{len(r['output_ids'])} outputs = shared-prefix on)"
        print(f"| {r['workload']} | {DTYPE_NAMES.get(r['dtype'], r['dtype'])} | {system} | "
              f"{r['output_tok_s']:.1f} | {ratio} | {ttft} | {hit} | {ideal} |")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="default: the bundled SmolLM2 GGUF")
    parser.add_argument("--workloads-dir", default=str(WORKLOADS_DIR))
    parser.add_argument("--workloads", default="W1,W2")
    parser.add_argument("--policies", default="fcfs,lpm,dfs-weight")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--peers", default="transformers", help="comma list: transformers, llamacpp")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="where the engine and transformers run"
    )
    parser.add_argument(
        "--limit", type=int, default=None, help="first N requests of each workload (smoke runs)"
    )
    parser.add_argument(
        "--overlap", default="on", help="comma list of on, off: the engine's overlap schedule"
    )
    parser.add_argument(
        "--kv-cache-dtypes",
        default="auto",
        help="comma list of the engine's --kv-cache-dtype values (auto, bfloat16, float16)",
    )
    parser.add_argument(
        "--shared-prefix", default="on", help="comma list of on, off: the engine's shared-prefix attention"
    )
    parser.add_argument(
        "--cpu-forward-stream",
        default="auto",
        choices=CPU_FORWARD_STREAMS,
        help="the engine's --cpu-forward-stream",
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "gguf", "none"],
        help="the engine's --quantization (none: float32 weights even for a GGUF's blocks)",
    )
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="seeded random weights of --model-path's shape (a folder with its config and tokenizer)",
    )
    parser.add_argument("--output", default=str(REPO / "bench_results" / "bench_offline.json"))
    args = parser.parse_args(argv)
    for name in ("workloads", "policies", "dtypes", "peers", "overlap", "kv_cache_dtypes", "shared_prefix"):
        setattr(args, name, [x for x in getattr(args, name).split(",") if x])
    if not args.overlap or set(args.overlap) - {"on", "off"}:
        parser.error(f"--overlap takes a comma list of on, off; got {','.join(args.overlap)!r}")
    if not args.shared_prefix or set(args.shared_prefix) - {"on", "off"}:
        parser.error(f"--shared-prefix takes a comma list of on, off; got {','.join(args.shared_prefix)!r}")
    if "llamacpp" in args.peers and args.random_weights:
        parser.error("--peers llamacpp needs the model's GGUF, not --random-weights")
    if "llamacpp" in args.peers and args.device != "cpu":
        parser.error("--peers llamacpp runs on the CPU only (llama-cpp-python's CPU build)")
    if not args.kv_cache_dtypes or set(args.kv_cache_dtypes) - set(KV_CACHE_DTYPES):
        parser.error(f"--kv-cache-dtypes takes a comma list of {', '.join(KV_CACHE_DTYPES)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.random_weights:
            from radixengine.model_loader import resolve_model_path

            args.model_path = random_weights_folder(resolve_model_path(args.model_path), Path(tmp))
        rows, load_before = run_all(args)
    print_table(rows)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": " ".join(sys.argv),
        "threads": args.threads,
        "cpu": _cpu_name(),
        "device": args.device,
        "gpu": _gpu_name() if args.device == "cuda" else None,
        "random_weights": args.random_weights,
        "time": time.ctime(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }
    with open(args.output, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    print(f"\nwrote {args.output}", file=sys.stderr)


def run_all(args) -> tuple[list[dict], tuple[float, float, float]]:
    from radixengine.model_loader import default_model_path, get_tokenizer, resolve_model_path

    args.gguf_path = args.model_path or default_model_path()
    hf_path = resolve_model_path(args.model_path)
    tokenizer = get_tokenizer(args.model_path)
    rows = []
    load_before = os.getloadavg()
    for dtype in args.dtypes:
        for name in args.workloads:
            items = load_workload(workload_path(name, args.workloads_dir))[: args.limit]
            rows += bench_workload(name, items, dtype, args, hf_path, tokenizer)
    return rows, load_before


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name()


if __name__ == "__main__":
    main()
