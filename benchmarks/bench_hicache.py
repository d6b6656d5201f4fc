"""The hierarchical cache's storage tier through the server (SGLang's HiCache flags).

    python benchmarks/bench_hicache.py --w1 ../shared/workloads/W1.jsonl            # both parts
    python benchmarks/bench_hicache.py --parts restart --max-new-tokens 32
    python benchmarks/bench_hicache.py --parts prefixes --num-prefixes 32 --prefix-len 1024 \\
        --requests-per-prefix 4 --max-total-tokens 8192

(a) `restart`: W1 against a server restarted between two runs. Each run (after an 8-token
unrelated warm-up request with `--warmup`) sends W1's first request
alone (its TTFT and prefill tokens: the system prompt after a restart), then the other 31 at
once. With the storage tier (`--enable-hierarchical-cache --hicache-storage-backend file`, a fresh
folder) the first run is cold and the second, after the restart, is warm; without it, both runs
are cold (the control).
(b) `prefixes`: many long shared prefixes whose total exceeds the KV pool: `--num-prefixes`
prefixes of `--prefix-len` random tokens, each asked `--requests-per-prefix` times (a distinct
32-token question each), round by round over all prefixes, at most `--concurrency` requests in
flight, against a pool of `--max-total-tokens`. Without the tier each round finds its prefix
evicted and prefills it again; with it, rounds after the first read it from storage.
`--prefix-tiers none,storage,host,host+storage` adds the host tier (SGLang's host memory pool
under the device pool, `--hicache-ratio`): GPU only, not measured on this project's CPU
machine; a CUDA run is e.g.
    python benchmarks/bench_hicache.py --parts prefixes --prefix-tiers none,host,host+storage \
        --num-prefixes 64 --prefix-len 2048 --max-total-tokens 16384 --hicache-ratio 4 Reported:
requests/s, output and total tokens/s, TTFT (mean, p50, p90), prefill and cached tokens.

Every request streams through /generate with input ids (the chat template applied here), greedy,
`ignore_eos`. Written as JSON with the machine (CPU model, load before and after, the folder's
disk) and the exact server flags; `--markdown` prints the tables for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import cpu_info, launch, stop  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Outcome:
    ttft: float = 0.0
    e2e: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    storage_tokens: int = 0
    host_tokens: int = 0
    output_tokens: int = 0
    error: str = ""
    output_ids: list[int] | None = None

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


async def generate(client: httpx.AsyncClient, ids: list[int], max_new: int) -> Outcome:
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
    }
    out, start = Outcome(), time.perf_counter()
    async with client.stream("POST", "/generate", json=body) as resp:
        if resp.status_code != 200:
            out.error = f"HTTP {resp.status_code}"
            return out
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out.error = str(chunk["error"])
                return out
            if out.ttft == 0.0 and chunk.get("output_ids"):
                out.ttft = time.perf_counter() - start
            out.output_ids = chunk.get("output_ids")
            meta = chunk.get("meta_info", {})
            out.prompt_tokens = meta.get("prompt_tokens", 0)
            out.cached_tokens = meta.get("cached_tokens", 0)
            out.output_tokens = meta.get("completion_tokens", 0)
            details = meta.get("cached_tokens_details") or {}
            out.storage_tokens, out.host_tokens = details.get("storage", 0), details.get("host", 0)
    out.e2e = time.perf_counter() - start
    return out


async def run_requests(
    port: int, prompts: list[list[int]], max_new: int, concurrency: int
) -> tuple[list[Outcome], float]:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=None) as client:

        async def one(ids: list[int]) -> Outcome:
            async with limit:
                return await generate(client, ids, max_new)

        start = time.perf_counter()
        outs = await asyncio.gather(*(one(p) for p in prompts))
        return list(outs), time.perf_counter() - start


def summary(outs: list[Outcome], elapsed: float) -> dict:
    ttfts = sorted(o.ttft for o in outs)
    out_tokens = sum(o.output_tokens for o in outs)
    prompt_tokens = sum(o.prompt_tokens for o in outs)
    return {
        "requests": len(outs),
        "errors": sum(bool(o.error) for o in outs),
        "elapsed_s": elapsed,
        "requests_per_s": len(outs) / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (out_tokens + prompt_tokens) / elapsed,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p90_s": ttfts[int(len(ttfts) * 0.9)],
        "prompt_tokens": prompt_tokens,
        "prefill_tokens": sum(o.prefill_tokens for o in outs),
        "cached_tokens": sum(o.cached_tokens for o in outs),
        "storage_tokens": sum(o.storage_tokens for o in outs),
        "host_tokens": sum(o.host_tokens for o in outs),
    }


def wait_written(folder: Path, settle_s: float = 2.0, timeout: float = 300.0) -> int:
    """Wait until the writer thread is done: the folder's page count stops changing."""
    deadline, last, since = time.monotonic() + timeout, -1, time.monotonic()
    while time.monotonic() < deadline:
        n = len(list(folder.glob("*/*.kv")))
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since > settle_s:
            return n
        time.sleep(0.2)
    return last


def storage_flags(folder: Path) -> list[str]:
    return [
        "--enable-hierarchical-cache",
        "--hicache-storage-backend", "file",
        "--hicache-storage-dir", str(folder),
        "--hicache-storage-prefetch-policy", "wait_complete",
    ]  # fmt: skip


def w1_prompts(path: str, model_path: str | None) -> list[list[int]]:
    from radixengine.model_loader import get_tokenizer

    tok = get_tokenizer(model_path)
    ids = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                item = json.loads(line)
                text = tok.apply_chat_template(item["messages"], add_generation_prompt=True, tokenize=False)
                ids.append(tok.encode(text, add_special_tokens=False))
    return ids


def part_restart(args, base_flags: list[str], folder: Path) -> list[dict]:
    """`--repeats` rounds; in each, with the tier and without, a fresh folder, then a server, W1's
    first request, a restart, W1's first request again. The other 31 requests run after the
    first request in the first round only (the machine is shared: TTFTs are compared by median
    over the rounds, the tiers interleaved)."""
    prompts = w1_prompts(args.w1, args.model_path)
    rows = []
    for rep in range(args.repeats):
        for tier in ("storage", "none"):
            shutil.rmtree(folder, ignore_errors=True)
            flags = base_flags + (storage_flags(folder) if tier == "storage" else [])
            for run in ("first", "after_restart"):
                rows.append(_restart_run(args, prompts, flags, folder, tier, run, rep))
                print(
                    json.dumps({k: rows[-1][k] for k in ("tier", "run", "repeat", "first_request")}),
                    flush=True,
                )
    return rows


def _restart_run(args, prompts, flags, folder: Path, tier: str, run: str, rep: int) -> dict:
    proc = launch(flags, args.port, Path(args.log_dir) / f"restart-{tier}-{run}-{rep}.log")
    try:
        if args.warmup:  # a short unrelated request first, as bench_serving does: start-up costs aside
            asyncio.run(run_requests(args.port, [list(range(1000, 1008))], 2, 1))
        load_before = os.getloadavg()[0]
        first, _ = asyncio.run(run_requests(args.port, prompts[:1], args.max_new_tokens, 1))
        rest = None
        if rep == 0:
            outs, elapsed = asyncio.run(
                run_requests(args.port, prompts[1:], args.max_new_tokens, len(prompts))
            )
            rest = summary(outs, elapsed)
        pages = wait_written(folder) if tier == "storage" else 0
    finally:
        stop(proc)
    return {
        "part": "restart",
        "tier": tier,
        "run": run,
        "repeat": rep,
        "load_1min_before": load_before,
        "first_request": asdict(first[0]) | {"prefill_tokens": first[0].prefill_tokens},
        "rest": rest,
        "pages_in_folder": pages,
        "server_flags": flags,
    }


def prefix_prompts(args) -> list[list[int]]:
    rng = random.Random(0)
    prefixes = [[rng.randrange(100, 49000) for _ in range(args.prefix_len)] for _ in range(args.num_prefixes)]
    return [
        p + [rng.randrange(100, 49000) for _ in range(32)]
        for _ in range(args.requests_per_prefix)
        for p in prefixes
    ]


def tier_flags(args, tier: str, folder: Path) -> list[str]:
    """`none`, `storage`, `host` (the host tier: GPU only; on a CPU it needs
    `--host-tier-on-cpu`, and measures copies within one memory), `host+storage`."""
    flags = storage_flags(folder) if "storage" in tier else []
    if "host" in tier:
        flags = flags or ["--enable-hierarchical-cache"]
        flags += ["--hicache-ratio", str(args.hicache_ratio), "--hicache-write-policy", args.write_policy]
        flags += ["--hicache-host-tier-on-cpu"] if args.host_tier_on_cpu else []
    return flags


def part_prefixes(args, base_flags: list[str], folder: Path) -> list[dict]:
    prompts = prefix_prompts(args)
    rows = []
    for tier in args.prefix_tiers.split(","):
        shutil.rmtree(folder, ignore_errors=True)
        flags = base_flags + ["--max-total-tokens", str(args.max_total_tokens)]
        flags += tier_flags(args, tier, folder)
        proc = launch(flags, args.port, Path(args.log_dir) / f"prefixes-{tier}.log")
        try:
            outs, elapsed = asyncio.run(
                run_requests(args.port, prompts, args.prefix_new_tokens, args.concurrency)
            )
        finally:
            stop(proc)
        rows.append({"part": "prefixes", "tier": tier, **summary(outs, elapsed), "server_flags": flags})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def machine(folder: Path) -> dict:
    def sh(cmd: str) -> str:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()

    folder.mkdir(parents=True, exist_ok=True)
    return {
        "cpu": cpu_info(),
        "nproc": os.cpu_count(),
        "lscpu_model": sh("lscpu | grep -i 'model name'"),
        "disk_of_folder": sh(f"df -h {folder}"),
        "lsblk": sh("lsblk -o NAME,SIZE,ROTA,TYPE,MOUNTPOINT 2>/dev/null"),
        "uptime": sh("uptime"),
    }


def markdown(data: dict) -> None:
    restart = [r for r in data["rows"] if r["part"] == "restart"]
    if restart:
        print(
            "| tier | run | 1st request: prefill tokens | from storage | TTFT median (ms) | TTFTs (ms) | same tokens as cold |"
        )
        print("|---|---|---|---|---|---|---|")
        for tier in ("storage", "none"):
            for run in ("first", "after_restart"):
                rows = [r for r in restart if r["tier"] == tier and r["run"] == run]
                if not rows:
                    continue
                f = rows[0]["first_request"]
                ttfts = [r["first_request"]["ttft"] * 1e3 for r in rows]
                cold = [r["first_request"]["output_ids"] for r in restart if r["run"] == "first"]
                same = all(r["first_request"]["output_ids"] == cold[0] for r in rows)
                print(f"| {tier} | {run} | {f['prefill_tokens']} of {f['prompt_tokens']} | {f['storage_tokens']} | "
                      f"{statistics.median(ttfts):.0f} | {', '.join(f'{t:.0f}' for t in ttfts)} | {same} |")  # fmt: skip
        print()
        print(
            "| tier | run | other 31: TTFT mean / p50 / p90 (ms) | prefill tokens | from storage | total tok/s |"
        )
        print("|---|---|---|---|---|---|")
        for r in restart:
            if r["rest"]:
                x = r["rest"]
                print(f"| {r['tier']} | {r['run']} | {x['ttft_mean_s'] * 1e3:.0f} / {x['ttft_p50_s'] * 1e3:.0f} / "
                      f"{x['ttft_p90_s'] * 1e3:.0f} | {x['prefill_tokens']} | {x['storage_tokens']} | "
                      f"{x['total_tokens_per_s']:.0f} |")  # fmt: skip
        print()
    prefixes = [r for r in data["rows"] if r["part"] == "prefixes"]
    if prefixes:
        print(
            "| tier | req/s | out tok/s | TTFT mean / p50 / p90 (ms) | prefill tokens | from host | from storage | elapsed (s) |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in prefixes:
            print(f"| {r['tier']} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | "
                  f"{r['ttft_mean_s'] * 1e3:.0f} / {r['ttft_p50_s'] * 1e3:.0f} / {r['ttft_p90_s'] * 1e3:.0f} | "
                  f"{r['prefill_tokens']} | {r.get('host_tokens', 0)} | {r['storage_tokens']} | {r['elapsed_s']:.1f} |")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="restart,prefixes")
    p.add_argument("--w1", default=str(REPO.parent / "shared" / "workloads" / "W1.jsonl"))
    p.add_argument("--model-path", default=None)
    p.add_argument("--server-flags", default="", help="more flags for every server")
    p.add_argument("--max-new-tokens", type=int, default=32, help="(a): output tokens per W1 request")
    p.add_argument("--repeats", type=int, default=3, help="(a): rounds of cold / restarted runs")
    p.add_argument("--warmup", action="store_true", help="(a): an 8-token request before W1's first")
    p.add_argument("--num-prefixes", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--requests-per-prefix", type=int, default=4)
    p.add_argument("--prefix-new-tokens", type=int, default=8, help="(b): output tokens per request")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-total-tokens", type=int, default=8192)
    p.add_argument(
        "--prefix-tiers",
        default="none,storage",
        help="(b): tiers to compare, of none, storage, host, host+storage (host: GPU only)",
    )
    p.add_argument("--hicache-ratio", type=float, default=2.0, help="(b): the host tier's size")
    p.add_argument(
        "--write-policy", default="write_through", help="(b): --hicache-write-policy of host tiers"
    )
    p.add_argument(
        "--host-tier-on-cpu",
        action="store_true",
        help="(b): pass --hicache-host-tier-on-cpu (a CPU run of the host tier: its logic, no speed-up)",
    )
    p.add_argument("--port", type=int, default=31235)
    p.add_argument("--folder", default=None, help="the storage folder (default: a fresh one under /tmp)")
    p.add_argument("--log-dir", default=str(Path(tempfile.gettempdir()) / "bench_hicache_logs"))
    p.add_argument("--output", default="docs/results/hicache.json")
    p.add_argument("--markdown", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    folder = Path(args.folder or tempfile.mkdtemp(prefix="hicache-bench-"))
    base = (["--model-path", args.model_path] if args.model_path else []) + args.server_flags.split()
    meta = {"command": " ".join(sys.argv), "machine_before": machine(folder)}
    rows: list[dict] = []
    if "restart" in args.parts:
        rows += part_restart(args, base, folder)
    if "prefixes" in args.parts:
        rows += part_prefixes(args, base, folder)
    meta["machine_after"] = {"uptime": machine(folder)["uptime"]}
    data = {"meta": meta, "rows": rows}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(data, indent=1))
    if args.markdown:
        markdown(data)
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
