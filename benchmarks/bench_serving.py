"""Online serving benchmark: open-loop load against an OpenAI-compatible server.

    python benchmarks/bench_serving.py --launch --request-rates 1,2,4          # starts our server
    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --request-rates inf --max-concurrency 8
    python benchmarks/bench_serving.py --launch --dataset ../shared/workloads/W1.jsonl --request-rates 2

Arrivals are Poisson at each request rate (`inf`: all at once), optionally capped by
`--max-concurrency`. Prompts come from a JSONL file (chat `messages` or `text`, optional
`sampling_params`) or are generated: `random` (distinct random-token prompts) or `shared-prefix`
(one common prefix, distinct suffixes). Every request streams; reported per rate: throughput
(requests/s, output and total tokens/s), TTFT, TPOT (time per output token after the first), ITL
(between stream chunks) and end-to-end latency, mean / p50 / p90 / p99, written as JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Request:
    body: dict  # JSON for /v1/chat/completions (messages) or /v1/completions (prompt)
    route: str


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0


# Prompts --------------------------------------------------------------------------------------


def load_dataset(path: str, model: str, max_tokens: int | None) -> list[Request]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            item = json.loads(line)
            params = item.get("sampling_params", {})
            body = {"model": model, "max_tokens": max_tokens or params.get("max_new_tokens", 128)}
            body["temperature"] = params.get("temperature", 0)
            body["ignore_eos"] = params.get("ignore_eos", True)
            if "messages" in item:
                out.append(Request({**body, "messages": item["messages"]}, "/v1/chat/completions"))
            else:
                out.append(Request({**body, "prompt": item.get("text") or item["prompt"]}, "/v1/completions"))
    return out


def generate_prompts(kind: str, n: int, input_len: int, output_len: int, prefix_len: int, model: str,
                     vocab: int, seed: int) -> list[Request]:  # fmt: skip
    """Token-id prompts (exact lengths); ids drawn from [100, vocab) to avoid special tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(100, vocab) for _ in range(prefix_len)] if kind == "shared-prefix" else []
    reqs = []
    for _ in range(n):
        ids = prefix + [rng.randrange(100, vocab) for _ in range(input_len - len(prefix))]
        body = {"model": model, "prompt": ids, "max_tokens": output_len, "temperature": 0, "ignore_eos": True}
        reqs.append(Request(body, "/v1/completions"))
    return reqs


# Load -----------------------------------------------------------------------------------------


async def send(client: httpx.AsyncClient, req: Request, headers: dict) -> Result:
    body = {**req.body, "stream": True, "stream_options": {"include_usage": True}}
    res = Result()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", req.route, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if not _has_content(chunk):
                    continue
                now = time.perf_counter()
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
        res.e2e = time.perf_counter() - start
        res.ok = True
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def _has_content(chunk: dict) -> bool:
    for choice in chunk.get("choices", []):
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def run_load(base_url: str, reqs: list[Request], rate: float, max_concurrency: int | None,
                   api_key: str | None, seed: int) -> tuple[list[Result], float]:  # fmt: skip
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(None), limits=limits) as client:

        async def one(req: Request) -> Result:
            if sem is None:
                return await send(client, req, headers)
            async with sem:
                return await send(client, req, headers)

        start = time.perf_counter()
        tasks = []
        for req in reqs:
            tasks.append(asyncio.ensure_future(one(req)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


# Report ---------------------------------------------------------------------------------------


def stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    values = sorted(values)

    def pct(q: float) -> float:
        return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]

    return {"mean": statistics.mean(values), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def summarize(results: list[Result], elapsed: float, rate: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "request_rate": rate,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": elapsed,
        "request_throughput": len(ok) / elapsed,
        "output_throughput": out_tokens / elapsed,
        "total_throughput": (in_tokens + out_tokens) / elapsed,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "ttft_s": stats([r.ttft for r in ok]),
        "tpot_s": stats(tpots),
        "itl_s": stats([x for r in ok for x in r.itls]),
        "e2e_s": stats([r.e2e for r in ok]),
    }


def print_table(rows: list[dict]) -> None:
    print("| rate (req/s) | done | req/s | out tok/s | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) | "
          "ITL p50 / p99 (ms) | e2e p50 / p99 (s) |")  # fmt: skip
    print("|" + "---|" * 8)
    for r in rows:
        def ms(d: dict, keys=("p50", "p90", "p99")) -> str:
            return " / ".join("–" if d[k] is None else f"{1000 * d[k]:.0f}" for k in keys)

        e2e = " / ".join("–" if r["e2e_s"][k] is None else f"{r['e2e_s'][k]:.2f}" for k in ("p50", "p99"))
        print(f"| {r['request_rate']} | {r['completed']}/{r['completed'] + r['failed']} | "
              f"{r['request_throughput']:.2f} | {r['output_throughput']:.1f} | {ms(r['ttft_s'])} | "
              f"{ms(r['tpot_s'])} | {ms(r['itl_s'], ('p50', 'p99'))} | {e2e} |")  # fmt: skip


# Server ---------------------------------------------------------------------------------------


def launch(server_flags: list[str], port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "radixengine.launch_server", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd + server_flags, cwd=REPO)
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("the server did not become ready")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server (default: --launch one)")
    p.add_argument("--launch", action="store_true", help="start `radixengine.launch_server` for the run")
    p.add_argument("--server-flags", default="", help="extra flags for the launched server, one string")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", default=None, help="JSONL prompts (messages or text); default: generated")
    p.add_argument("--dataset-name", choices=("random", "shared-prefix"), default="shared-prefix")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=192, help="shared-prefix: tokens in the common prefix")
    p.add_argument("--max-tokens", type=int, default=None, help="override a dataset's max_new_tokens")
    p.add_argument("--request-rates", default="1,2,4", help="comma list of req/s; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=str(REPO / "bench_results" / "bench_serving.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    proc = None
    if args.base_url is None:
        from radixengine.utils.network import get_free_port

        port = get_free_port()
        proc = launch(args.server_flags.split(), port)
        args.base_url = f"http://127.0.0.1:{port}"
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model_card = httpx.get(f"{args.base_url}/v1/models", headers=headers).json()["data"][0]
        model = model_card["id"]
        if args.dataset:
            reqs = load_dataset(args.dataset, model, args.max_tokens)
        else:
            vocab = _vocab_size(args.base_url, headers)
            reqs = generate_prompts(args.dataset_name, args.num_prompts, args.input_len, args.output_len,
                                    args.prefix_len, model, vocab, args.seed)  # fmt: skip
        rows = []
        for rate_s in args.request_rates.split(","):
            rate = float(rate_s)
            httpx.post(f"{args.base_url}/flush_cache", headers=headers)
            print(f"rate {rate} req/s, {len(reqs)} requests ...", file=sys.stderr, flush=True)
            results, elapsed = asyncio.run(
                run_load(args.base_url, reqs, rate, args.max_concurrency, args.api_key, args.seed)
            )
            rows.append(summarize(results, elapsed, rate))
        print_table(rows)
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        meta = {"command": " ".join(sys.argv), "model": model, "cpus": os.cpu_count(), "time": time.ctime()}
        with open(args.output, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
        print(f"\nwrote {args.output}", file=sys.stderr)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


def _vocab_size(base_url: str, headers: dict) -> int:
    info = httpx.get(f"{base_url}/get_server_info", headers=headers).json()
    return int(info.get("vocab_size") or 32000)


if __name__ == "__main__":
    main()
