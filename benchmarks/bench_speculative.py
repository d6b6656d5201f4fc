"""Speculative decoding (NGRAM, STANDALONE) against speculation off, in one run: the copy-heavy
workload W4 (benchmarks/workloads, made by make_copy_workload.py) and W2, at several batch sizes.

    python benchmarks/bench_speculative.py                          # W4, W2; batch 1, 4, 8, 16, 32
    python benchmarks/bench_speculative.py --workloads W4 --batch-sizes 1,8 --repeats 3
    python benchmarks/bench_speculative.py --num-draft-tokens 12 --max-verify-tokens 128
    python benchmarks/bench_speculative.py --modes off,NGRAM        # no draft model

One offline `Engine` per mode stays up side by side (the default model unless --model-path,
greedy as in the workloads): speculation off, `speculative_algorithm="NGRAM"`, and
`"STANDALONE"` with --draft-model-path, by default a draft made here: the target's config with
--random-draft-layers layers and seeded random weights (its tokenizer is the target's). A random
draft's tokens are almost never accepted, so its row measures what drafting costs, the floor of
STANDALONE; a trained draft of the same shape costs the same per step and gains with its accept
length. For each workload, batch size and repeat every mode runs the same requests, the order
rotating between repeats, with the prefix cache flushed before each run. Batch b: the workload's first b requests submitted at
once; batch 1: the first --batch1-requests requests one after the other. Reported per run (the
fastest repeat): output tok/s, TPOT (mean over requests of the time per output token after the
first, streamed), the accept length (tokens a request takes from a verify step: the scheduler's
avg_spec_accept_length over this run), the share of decode steps that verified, the ratio
on/off, how many requests gave the same tokens on and off (all of them, for greedy), the mean
time to first token and the spread of the requests' finish times (the run ends with the slowest).
Writes --output (JSON), a copy in docs/results/ with --docs-copy, and --plot (PNG)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_offline import WORKLOADS_DIR, _cpu_name, load_workload, workload_path  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODES = ("off", "NGRAM", "STANDALONE")


@dataclass
class RunResult:
    elapsed_s: float
    output_tokens: int
    tpots: list[float]
    ttfts: list[float]
    finishes: list[float]  # seconds from the run's start
    output_ids: list[list[int]]
    spec_reqs: int
    spec_tokens: float
    decode_steps: int

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s


@dataclass
class Streamed:
    start: float
    first: float | None
    end: float
    ids: list[int]
    tokens: int

    @property
    def tpot(self) -> float:
        if self.first is None or self.tokens < 2:
            return float("nan")
        return (self.end - self.first) / (self.tokens - 1)


async def _stream_one(engine, item: dict, sampling_params: dict) -> Streamed:
    start, first, ids, meta = time.perf_counter(), None, [], {}
    stream = await engine.async_generate(
        messages=item.get("messages"), prompt=item.get("text"), sampling_params=sampling_params, stream=True
    )
    async for chunk in stream:
        if first is None and chunk["output_ids"]:
            first = time.perf_counter()
        ids += chunk["output_ids"]
        meta = chunk["meta_info"]
    return Streamed(start, first, time.perf_counter(), ids, meta.get("completion_tokens", len(ids)))


async def _run_batch(engine, items: list[dict], params: list[dict]) -> list[Streamed]:
    return await asyncio.gather(*(_stream_one(engine, i, p) for i, p in zip(items, params)))


def _spec_counters(engine) -> tuple[int, float, int]:
    info = engine.get_server_info()
    reqs = info.get("num_spec_verify_reqs", 0)
    return reqs, reqs * info.get("avg_spec_accept_length", 0.0), info.get("num_forward_steps", 0)


def run_once(engine, items: list[dict], params: list[dict], sequential: bool) -> RunResult:
    engine.flush_cache()
    reqs0, tokens0, steps0 = _spec_counters(engine)
    start = time.perf_counter()
    if sequential:
        results = [asyncio.run(_run_batch(engine, [i], [p]))[0] for i, p in zip(items, params)]
    else:
        results = asyncio.run(_run_batch(engine, items, params))
    elapsed = time.perf_counter() - start
    reqs1, tokens1, steps1 = _spec_counters(engine)
    return RunResult(
        elapsed_s=elapsed,
        output_tokens=sum(r.tokens for r in results),
        tpots=[r.tpot for r in results],
        ttfts=[r.first - r.start for r in results if r.first is not None],
        finishes=[r.end - start for r in results],
        output_ids=[r.ids for r in results],
        spec_reqs=reqs1 - reqs0,
        spec_tokens=tokens1 - tokens0,
        decode_steps=steps1 - steps0,
    )


def _params(items: list[dict], max_new_tokens: int | None, stop_at_eos: bool = False) -> list[dict]:
    out = []
    for item in items:
        p = dict(item["sampling_params"])
        if max_new_tokens is not None:
            p["max_new_tokens"] = max_new_tokens
        if stop_at_eos:
            p["ignore_eos"] = False
        out.append(p)
    return out


def _mode_order(modes: list[str], repeat: int, shift: int) -> list[str]:
    k = (repeat + shift) % len(modes)
    return modes[k:] + modes[:k]


def bench_point(engines: dict, name: str, items: list[dict], bs: int, args, shift: int) -> list[dict]:
    sequential = bs == 1
    batch = items[: args.batch1_requests] if sequential else items[:bs]
    params = _params(batch, args.max_new_tokens, args.stop_at_eos)
    modes = list(engines)
    runs: dict[str, list[RunResult]] = {m: [] for m in modes}
    for r in range(args.repeats):
        for mode in _mode_order(modes, r, shift):
            print(f"[{name} bs={bs} repeat {r + 1}] {mode} ...", file=sys.stderr, flush=True)
            runs[mode].append(run_once(engines[mode], batch, params, sequential))
    best = {m: max(runs[m], key=lambda x: x.output_tok_s) for m in modes}
    off = best["off"]
    return [_row(name, bs, len(batch), sequential, mode, best[mode], runs[mode], off) for mode in modes]


def _row(name: str, bs: int, requests: int, sequential: bool, mode: str, b: RunResult, runs, off) -> dict:
    return {
        "workload": name,
        "batch_size": bs,
        "requests": requests,
        "sequential": sequential,
        "speculative_algorithm": None if mode == "off" else mode,
        "output_tokens": b.output_tokens,
        "elapsed_s": b.elapsed_s,
        "output_tok_s": b.output_tok_s,
        "output_tok_s_all_repeats": [x.output_tok_s for x in runs],
        "tpot_mean_s": statistics.mean(t for t in b.tpots if t == t) if b.output_tokens else None,
        "ttft_mean_s": statistics.mean(b.ttfts) if b.ttfts else None,
        "finish_first_s": min(b.finishes),
        "finish_last_s": max(b.finishes),
        "avg_spec_accept_length": b.spec_tokens / b.spec_reqs if b.spec_reqs else None,
        "spec_verify_reqs": b.spec_reqs,
        "forward_steps": b.decode_steps,
        "ratio_vs_off": b.output_tok_s / off.output_tok_s,
        "same_tokens_as_off": sum(a == o for a, o in zip(b.output_ids, off.output_ids)),
        "first_difference_at": [_first_difference(a, o) for a, o in zip(b.output_ids, off.output_ids)],
    }


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """The first output position where two outputs differ (None: identical)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def random_draft(target_path: str | None, layers: int, root: Path) -> str:
    """A draft of the target's tokenizer and config with `layers` layers and seeded random weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from radixengine.model_loader.default_model import default_model_path
    from radixengine.model_loader.gguf_loader import convert_gguf, is_gguf

    source = Path(target_path or default_model_path())
    if is_gguf(source):
        source = convert_gguf(source)
    folder = root / f"random_draft_{layers}_layers"
    folder.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".gguf", ".index.json", ".done")):
            shutil.copy(f, folder / f.name)
    config = AutoConfig.from_pretrained(source)
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(folder)
    return str(folder)


def make_engines(args) -> dict:
    from radixengine import Engine

    common = dict(
        model_path=args.model_path,
        log_level="warning",
        max_total_tokens=args.max_total_tokens,
        **({"num_threads": args.threads} if args.threads else {}),
        cpu_forward_stream=args.cpu_forward_stream,
        disable_overlap_schedule=args.disable_overlap_schedule,
    )
    budget = dict(speculative_max_verify_tokens=args.max_verify_tokens)
    specs = {
        "off": {},
        "NGRAM": dict(
            speculative_algorithm="NGRAM", speculative_num_draft_tokens=args.num_draft_tokens, **budget
        ),
        "STANDALONE": dict(
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=args.draft_model_path,
            speculative_num_steps=args.draft_steps,
            **budget,
        ),
    }
    engines = {mode: Engine(**common, **specs[mode]) for mode in args.modes}
    for engine in engines.values():
        engine.generate("Warm-up.", {"max_new_tokens": 8, "temperature": 0})
    return engines


def run_all(args, save) -> list[dict]:
    """Every point; `save(rows)` after each, so that a run cut short keeps what it measured."""
    paths = {name: workload_path(name, args.workloads_dir) for name in args.workloads}
    missing = [str(p) for p in paths.values() if not p.exists()]
    if missing:
        raise SystemExit(f"workloads not found: {', '.join(missing)} (see --workloads-dir)")
    engines = make_engines(args)
    try:
        rows = []
        for name, path in paths.items():
            items = load_workload(path)
            for bs in args.batch_sizes:
                rows += bench_point(engines, name, items, bs, args, shift=len(rows) // len(engines))
                save(rows)
        return rows
    finally:
        for engine in engines.values():
            engine.shutdown()


def _fmt(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def print_table(rows: list[dict]) -> None:
    print(
        "| workload | batch | speculation | output tok/s | TPOT (ms) | TTFT (ms) | finish first–last (s) "
        "| accept length | × off | same tokens as off |"
    )
    print("|" + "---|" * 10)
    for r in rows:
        batch = f"1 (×{r['requests']} in turn)" if r["sequential"] else str(r["batch_size"])
        tpot = _fmt(r["tpot_mean_s"] and r["tpot_mean_s"] * 1000, ".1f")
        ttft = _fmt(r["ttft_mean_s"] and r["ttft_mean_s"] * 1000, ".0f")
        finish = f"{r['finish_first_s']:.2f}–{r['finish_last_s']:.2f}"
        same = f"{r['same_tokens_as_off']}/{r['requests']}" if r["speculative_algorithm"] else "–"
        print(f"| {r['workload']} | {batch} | {r['speculative_algorithm'] or 'off'} | {r['output_tok_s']:.1f} | "
              f"{tpot} | {ttft} | {finish} | {_fmt(r['avg_spec_accept_length'], '.2f')} | "
              f"{r['ratio_vs_off']:.2f} | {same} |")  # fmt: skip


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    series = dict.fromkeys((r["workload"], r["speculative_algorithm"] or "off") for r in rows)
    styles = {"off": "s--", "NGRAM": "o-", "STANDALONE": "^-"}
    for workload, mode in series:
        points = [
            r for r in rows if r["workload"] == workload and (r["speculative_algorithm"] or "off") == mode
        ]
        bss = [r["batch_size"] for r in points]
        axes[0].plot(bss, [r["output_tok_s"] for r in points], styles[mode], label=f"{workload} {mode}")
        if mode != "off":
            axes[1].plot(bss, [r["ratio_vs_off"] for r in points], styles[mode], label=f"{workload} {mode}")
    axes[0].set(xscale="log", xlabel="batch size", ylabel="output tok/s", title="throughput")
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].set(
        xscale="log", xlabel="batch size", ylabel="× speculation off", title="speed-up (output tok/s)"
    )
    for ax in axes:
        ax.legend(fontsize=8)
        ax.set_xticks(sorted({r["batch_size"] for r in rows}), labels=None)
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="default: the bundled SmolLM2 GGUF")
    parser.add_argument("--workloads-dir", default=str(WORKLOADS_DIR))
    parser.add_argument("--workloads", default="W4,W2")
    parser.add_argument("--batch-sizes", default="1,4,8,16,32")
    parser.add_argument(
        "--batch1-requests", type=int, default=4, help="batch 1: requests run one after another"
    )
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the workload's")
    parser.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="answers end at the model's end of turn (the workloads set ignore_eos: every request "
        "writes max_new_tokens, past its answer)",
    )
    parser.add_argument("--modes", default="off,NGRAM,STANDALONE", help="off plus any of NGRAM, STANDALONE")
    parser.add_argument(
        "--num-draft-tokens", type=int, default=8, help="NGRAM: --speculative-num-draft-tokens"
    )
    parser.add_argument(
        "--draft-model-path",
        default=None,
        help="STANDALONE's draft (default: a random one, --random-draft-layers)",
    )
    parser.add_argument("--random-draft-layers", type=int, default=4, help="layers of the random draft")
    parser.add_argument("--draft-steps", type=int, default=3, help="STANDALONE: --speculative-num-steps")
    parser.add_argument("--max-verify-tokens", type=int, default=32, help="--speculative-max-verify-tokens")
    parser.add_argument(
        "--repeats", type=int, default=2, help="alternating runs per point; the fastest is kept"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="the engine's --num-threads (default: all cores)"
    )
    parser.add_argument("--max-total-tokens", type=int, default=65536, help="each engine's KV pool")
    parser.add_argument(
        "--cpu-forward-stream",
        default="auto",
        help="both engines' --cpu-forward-stream (thread: the overlap loop runs even when the forward's "
        "threads use every core)",
    )
    parser.add_argument(
        "--disable-overlap-schedule", action="store_true", help="both engines run the normal step order"
    )
    parser.add_argument("--output", default=str(REPO / "bench_results" / "bench_speculative.json"))
    parser.add_argument("--docs-copy", action="store_true", help="also copy the JSON to docs/results/")
    parser.add_argument("--plot", default=str(REPO / "docs" / "results" / "bench_speculative.png"))
    args = parser.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    args.modes = [m for m in args.modes.split(",") if m]
    if (
        args.modes[:1] != ["off"]
        or not set(args.modes) <= set(MODES)
        or len(set(args.modes)) != len(args.modes)
    ):
        parser.error(f"--modes: off first, then any of {', '.join(MODES[1:])}")
    if args.repeats < 1 or not args.batch_sizes or min(args.batch_sizes) < 1:
        parser.error("--repeats and every batch size must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_before = os.getloadavg()

    def save(rows: list[dict]) -> None:
        meta = _meta(args, load_before)
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        with open(args.output, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)

    if "STANDALONE" in args.modes and args.draft_model_path is None:
        args.draft_model_path = random_draft(
            args.model_path, args.random_draft_layers, Path(args.output).parent
        )
    rows = run_all(args, save)
    print_table(rows)
    save(rows)
    print(f"\nwrote {args.output}", file=sys.stderr)
    if args.docs_copy:
        copy = REPO / "docs" / "results" / "bench_speculative.json"
        shutil.copy(args.output, copy)
        print(f"wrote {copy}", file=sys.stderr)
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)


def _meta(args, load_before) -> dict:
    return {
        "command": " ".join(sys.argv),
        "cpu": _cpu_name(),
        "threads": args.threads or os.cpu_count(),
        "time": time.ctime(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "num_draft_tokens": args.num_draft_tokens,
        "max_verify_tokens": args.max_verify_tokens,
        "stop_at_eos": args.stop_at_eos,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "cpu_forward_stream": args.cpu_forward_stream,
        "disable_overlap_schedule": args.disable_overlap_schedule,
        "modes": args.modes,
        "draft_model_path": args.draft_model_path,
        "draft_steps": args.draft_steps,
        "random_draft_layers": args.random_draft_layers,
    }


if __name__ == "__main__":
    main()
