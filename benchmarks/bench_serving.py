"""Online serving benchmark: open-loop load against an OpenAI-compatible server, with the offline
`Engine` on the same requests for comparison.

    python benchmarks/bench_serving.py --launch --request-rates 1,2,4          # starts our server
    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --request-rates inf --max-concurrency 8
    python benchmarks/bench_serving.py --launch --dataset ../shared/workloads/W1.jsonl --request-rates 2

Load sweep relative to the saturation rate (first all requests at once; its completed requests/s
is the saturation rate; then Poisson arrivals at each fraction of it):

    python benchmarks/bench_serving.py --saturation --rate-fractions 0.25,0.5,0.8,1.0,1.5 --plot load.png

(each configuration measures its own saturation rate; `--saturation-rate R` fixes it instead, so
that several configurations are offered the same rates).

Sustained overload (all N requests at once against a pool smaller than their demand, so that
admission, refill and retraction all run; then the same N requests through the offline Engine):

    python benchmarks/bench_serving.py --overload 256 --dataset-name random --input-len 128 --output-len 64 \\
        --server-flags "--max-total-tokens 8192"

Workloads through the server (32 concurrent chat requests) and through the offline Engine:

    python benchmarks/bench_serving.py --dataset ../shared/workloads/W1.jsonl,../shared/workloads/W2.jsonl \\
        --request-rates inf --max-concurrency 32 --offline --dtypes bfloat16,float32

`--mixed-chunk on,off` runs every scenario with and without the server's `--enable-mixed-chunk`;
`--shared-prefix on,off` with shared-prefix attention on and off (`--disable-shared-prefix-attention`);
`--dtypes` every scenario in each dtype (bfloat16 also on a CPU without bf16 arithmetic: its
linears then run on bf16 panels, `layers/bf16_linear.py`). Each (dtype, mixed
chunk) configuration gets a fresh server; the offline Engine runs after that server has stopped,
with the same server arguments.

Before the runs each target gets a short warm-up request; the prefix cache is flushed before
every run. Arrivals are Poisson at each request rate (`inf`: all at once; fixed seed, so every
rate replays the same unit-rate arrival sequence, scaled), optionally capped by
`--max-concurrency`. Prompts come from JSONL files (chat `messages` or `text`, optional
`sampling_params`) or are generated (fixed seed): `random` (distinct random-token prompts) or
`shared-prefix` (one common prefix, distinct suffixes). Every request streams. Reported per run:
throughput (requests/s, output and total tokens/s), TTFT, TPOT (time per output token after the
first), ITL (between stream chunks) and end-to-end latency, mean / p50 / p90 / p99; queue time
(from the server's `/metrics` histogram: the HTTP API does not return it per request); the
scheduler's counters over the run (retracted requests, prefill and cached tokens, forward steps);
CPU seconds per process; and, once the server is idle again, the token-accounting invariant
`available + evictable + protected == max_total_tokens`. Written as JSON (with the CPU model and
flags, torch version, threads, load averages and the command line), after each configuration;
`--markdown` prints paste-ready tables, `--plot` draws throughput and p99 TTFT against the
offered rate, `--from-json` redraws both from a saved run."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
INF = float("inf")
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")  # fmt: skip
QUEUE_METRIC = "sglang:queue_time_seconds"
COUNTERS = ("num_retracted_reqs", "num_preempted_reqs", "num_prefill_tokens", "num_cached_tokens",
            "num_generated_tokens", "num_forward_steps")  # fmt: skip
DEFINITIONS = {
    "ttft_s": "server: request sent to first non-empty content chunk; offline: call to first output ids",
    "tpot_s": "(e2e - TTFT) / (output tokens - 1), per request",
    "itl_s": "time between content chunks (several tokens in one chunk count once)",
    "queue_time_s": "scheduler queue wait (arrival to first admission into a prefill batch), from the "
    "sglang:queue_time_seconds histogram of /metrics diffed over the run: count and mean are exact, "
    "percentiles are interpolated inside the histogram's buckets; not exposed per request over HTTP",
    "counters": "the scheduler's cumulative counters (get_server_info) after the run minus before it",
    "accounting": "get_server_info once the server is idle: ok when available + evictable + protected "
    "== max_total_tokens (leaked = max_total_tokens - that sum); protected should be 0 when idle",
    "demand_tokens": "sum over requests of prompt tokens + max new tokens (no prefix sharing counted)",
    "cpu_s": "CPU seconds over the run: bench_process = this process (the HTTP client; for the offline "
    "Engine also its tokenizer manager thread); front_end = the server's own process (HTTP, tokenizer "
    "manager; null offline); scheduler_and_detokenizer = the child processes (per_child by pid)",
    "saturation_rate": "completed requests / duration with every request sent at once (rate inf)",
}


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
    cached_tokens: int = 0
    last_chunk: float = 0.0  # when the previous content chunk arrived

    def content_chunk(self, start: float) -> None:
        """A chunk with content arrived now: the first sets TTFT, the rest add an ITL."""
        now = time.perf_counter()
        if self.ttft == 0.0:
            self.ttft = now - start
        else:
            self.itls.append(now - self.last_chunk)
        self.last_chunk = now


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


# Load through the server ----------------------------------------------------------------------


async def send(client: httpx.AsyncClient, req: Request, headers: dict) -> Result:
    body = {**req.body, "stream": True, "stream_options": {"include_usage": True}}
    res = Result()
    start = time.perf_counter()
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
                    usage = chunk["usage"]
                    res.prompt_tokens = usage["prompt_tokens"]
                    res.output_tokens = usage["completion_tokens"]
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                if _has_content(chunk):
                    res.content_chunk(start)
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


async def open_loop(
    reqs: list, rate: float, max_concurrency: int | None, seed: int, one
) -> tuple[list, float]:
    """Start `one(req)` for each request at Poisson arrival times (all at once for rate inf), at
    most `max_concurrency` in flight; the results in request order and the wall time."""
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def limited(req):
        if sem is None:
            return await one(req)
        async with sem:
            return await one(req)

    start = time.perf_counter()
    tasks = []
    for req in reqs:
        tasks.append(asyncio.ensure_future(limited(req)))
        if rate != INF:
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


async def run_load(base_url: str, reqs: list[Request], rate: float, max_concurrency: int | None,
                   api_key: str | None, seed: int) -> tuple[list[Result], float]:  # fmt: skip
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(None), limits=limits) as client:
        return await open_loop(reqs, rate, max_concurrency, seed, lambda req: send(client, req, headers))


# Load through the offline Engine --------------------------------------------------------------


def engine_call(req: Request) -> dict:
    """The Engine.async_generate arguments for a server request body."""
    body = req.body
    params = {"max_new_tokens": body["max_tokens"], "temperature": body.get("temperature", 0),
              "ignore_eos": body.get("ignore_eos", False)}  # fmt: skip
    if "messages" in body:
        return {"messages": body["messages"], "sampling_params": params}
    prompt = body["prompt"]
    key = "input_ids" if isinstance(prompt, list) else "prompt"
    return {key: prompt, "sampling_params": params}


async def engine_send(engine, req: Request) -> Result:
    """One streamed request through the Engine, timed like `send` (first output ids, not text)."""
    res = Result()
    start = time.perf_counter()
    try:
        stream = await engine.async_generate(**engine_call(req), stream=True)
        async for chunk in stream:
            meta = chunk["meta_info"]
            res.prompt_tokens, res.output_tokens = meta["prompt_tokens"], meta["completion_tokens"]
            res.cached_tokens = meta.get("cached_tokens") or 0
            if chunk["output_ids"]:
                res.content_chunk(start)
        res.e2e = time.perf_counter() - start
        res.ok = True
    except Exception as e:  # a refused or aborted request fails alone, as over HTTP
        res.error = f"{type(e).__name__}: {e}"
    return res


# Targets: the server over HTTP, or the Engine in this process ---------------------------------


def process_tree_cpu(pid: int) -> dict[str, float] | None:
    """User + system CPU seconds so far of a process ("root") and of its live descendants, each
    under its pid ("children" sums them)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return None
    out = {}
    for proc in procs:
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        out["root" if proc.pid == pid else str(proc.pid)] = t.user + t.system
    return out


def _cpu_diff(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    diff = {k: after[k] - before.get(k, 0.0) for k in after}
    children = {k: v for k, v in diff.items() if k != "root"}
    return {"root": diff.get("root"), "children": sum(children.values()), "per_child": children}


class ServerTarget:
    kind = "server"

    def __init__(self, base_url: str, api_key: str | None, pid: int | None = None) -> None:
        self.base_url, self.api_key, self.pid = base_url, api_key, pid
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def engine_cpu(self) -> dict | None:
        """The server's process (HTTP, tokenizer manager) as root; scheduler, detokenizer as children."""
        return process_tree_cpu(self.pid) if self.pid else None

    def info(self) -> dict:
        return httpx.get(f"{self.base_url}/get_server_info", headers=self.headers, timeout=60).json()

    def metrics_text(self) -> str | None:
        resp = httpx.get(f"{self.base_url}/metrics", headers=self.headers, timeout=60)
        return resp.text if resp.status_code == 200 else None

    def flush(self) -> None:
        for _ in range(50):
            if (
                httpx.post(f"{self.base_url}/flush_cache", headers=self.headers, timeout=60).status_code
                == 200
            ):
                return
            time.sleep(0.2)  # refused while requests run
        print("warning: /flush_cache kept failing; the run starts with a warm cache", file=sys.stderr)

    def warmup(self, model: str) -> None:
        body = {"model": model, "prompt": "Warm-up.", "max_tokens": 8, "temperature": 0}
        httpx.post(f"{self.base_url}/v1/completions", json=body, headers=self.headers, timeout=None)

    def run(self, reqs: list[Request], rate: float, max_concurrency: int | None, seed: int):
        return asyncio.run(run_load(self.base_url, reqs, rate, max_concurrency, self.api_key, seed))


class EngineTarget:
    kind = "offline"

    def __init__(self, engine) -> None:
        self.engine = engine

    def engine_cpu(self) -> dict | None:
        """This process (client and the Engine's tokenizer manager thread) as root; scheduler and
        detokenizer as children."""
        return process_tree_cpu(os.getpid())

    def info(self) -> dict:
        return self.engine.get_server_info()

    def metrics_text(self) -> str | None:
        metrics = self.engine.tokenizer_manager.metrics
        return metrics.render(None).decode() if metrics is not None else None

    def flush(self) -> None:
        for _ in range(50):
            if self.engine.flush_cache():
                return
            time.sleep(0.2)

    def warmup(self, model: str) -> None:
        self.engine.generate("Warm-up.", {"max_new_tokens": 8, "temperature": 0})

    def run(self, reqs: list[Request], rate: float, max_concurrency: int | None, seed: int):
        async def go():
            return await open_loop(
                reqs, rate, max_concurrency, seed, lambda req: engine_send(self.engine, req)
            )

        return asyncio.run(go())


# Server state, queue time, accounting ---------------------------------------------------------


def wait_idle(target, timeout: float = 120.0) -> tuple[dict, float]:
    """get_server_info once nothing runs or waits (and the seconds that took)."""
    start = time.perf_counter()
    while True:
        info = target.info()
        idle = not info.get("num_running_reqs") and not info.get("num_queue_reqs")
        if idle or time.perf_counter() - start > timeout:
            if idle:
                time.sleep(0.3)  # let the idle step (and its self-check) run
                info = target.info()
            return info, time.perf_counter() - start
        time.sleep(0.2)


def accounting(info: dict) -> dict:
    keys = ("available_tokens", "evictable_tokens", "protected_tokens", "max_total_tokens")
    if any(info.get(k) is None for k in keys):
        return {
            "ok": None,
            "reason": "the server does not report " + ", ".join(k for k in keys if k not in info),
        }
    available, evictable, protected, total = (int(info[k]) for k in keys)
    counted = available + evictable + protected
    return {
        "ok": counted == total,
        "leaked": total - counted,
        "available_tokens": available,
        "evictable_tokens": evictable,
        "protected_tokens": protected,
        "max_total_tokens": total,
        "idle": not info.get("num_running_reqs") and not info.get("num_queue_reqs"),
        "protected_zero_when_idle": protected == 0,
    }


def queue_histogram(text: str | None) -> dict | None:
    """{le: cumulative count} plus `_sum` / `_count` of the queue-time histogram (all label sets)."""
    if text is None:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    hist: dict = {"_sum": 0.0, "_count": 0.0, "buckets": {}}
    for family in text_string_to_metric_families(text):
        if family.name != QUEUE_METRIC:
            continue
        for s in family.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                hist["buckets"][le] = hist["buckets"].get(le, 0.0) + s.value
            elif s.name.endswith("_sum"):
                hist["_sum"] += s.value
            elif s.name.endswith("_count"):
                hist["_count"] += s.value
    return hist


def queue_time_stats(before: dict | None, after: dict | None) -> dict:
    if before is None or after is None:
        return {"source": None, "reason": "metrics are off (--enable-metrics) or /metrics is unreachable"}
    count = after["_count"] - before["_count"]
    out = {"source": "/metrics histogram " + QUEUE_METRIC + " (bucketed)", "count": int(count)}
    if count <= 0:
        return {**out, "mean": None, "p50": None, "p90": None, "p99": None}
    buckets = sorted((le, after["buckets"][le] - before["buckets"].get(le, 0.0)) for le in after["buckets"])
    out["mean"] = (after["_sum"] - before["_sum"]) / count
    for q in (50, 90, 99):
        out[f"p{q}"] = _bucket_quantile(buckets, count, q / 100)
    return out


def _bucket_quantile(buckets: list[tuple[float, float]], count: float, q: float) -> float:
    """Prometheus' histogram_quantile: linear inside the bucket holding the rank."""
    rank, lower, below = q * count, 0.0, 0.0
    for le, cumulative in buckets:
        if cumulative >= rank:
            if le == INF:
                return lower  # beyond the last finite bound
            inside = cumulative - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = le, cumulative
    return lower


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
    ttft = stats([r.ttft for r in ok])
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
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "ttft_s": ttft,
        "ttft_p99_over_p50": ttft["p99"] / ttft["p50"] if ttft["p50"] else None,
        "tpot_s": stats(tpots),
        "itl_s": stats([x for r in ok for x in r.itls]),
        "e2e_s": stats([r.e2e for r in ok]),
    }


def measure(target, reqs: list[Request], rate: float, args, **labels) -> dict:
    """One run on a flushed cache: the client-side summary, the scheduler's counters over the run,
    queue time, and the accounting once idle."""
    target.flush()
    before = target.info()
    hist_before = queue_histogram(target.metrics_text())
    load_before = os.getloadavg()
    cpu_before = target.engine_cpu(), time.process_time()
    what = f"{target.kind} {labels.get('request_set')} rate {rate:.3g} req/s, {len(reqs)} requests"
    print(what + " ...", file=sys.stderr, flush=True)
    results, elapsed = target.run(reqs, rate, args.max_concurrency, args.seed)
    load_after = os.getloadavg()
    cpu_after = target.engine_cpu(), time.process_time()
    after, idle_wait = wait_idle(target)
    row = {"target": target.kind, **labels}
    row.update(summarize(results, elapsed, rate))
    row["max_concurrency"] = args.max_concurrency
    row["queue_time_s"] = queue_time_stats(hist_before, queue_histogram(target.metrics_text()))
    row["counters"] = {k: after[k] - before[k] for k in COUNTERS if k in after and k in before}
    row["accounting"] = accounting(after)
    row["idle_wait_s"] = idle_wait
    row["server_state_after"] = {k: after.get(k) for k in (*COUNTERS, "num_running_reqs", "num_queue_reqs",
                                                           "token_usage", "cache_hit_rate")}  # fmt: skip
    row["max_total_tokens"] = after.get("max_total_tokens")
    max_new = sum(r.body["max_tokens"] for r in reqs)
    row["demand_tokens"] = row["prompt_tokens"] + max_new if not row["failed"] else None
    if row["demand_tokens"] and row["max_total_tokens"]:
        row["pool_smaller_than_demand"] = row["max_total_tokens"] < row["demand_tokens"]
    row["load_average_before"], row["load_average_after"] = load_before, load_after
    cpu = _cpu_diff(cpu_before[0], cpu_after[0]) or {}
    row["cpu_s"] = {"bench_process": cpu_after[1] - cpu_before[1], "front_end": cpu.get("root"),
                    "scheduler_and_detokenizer": cpu.get("children"), "per_child": cpu.get("per_child")}  # fmt: skip
    if target.kind == "offline":
        row["cpu_s"]["front_end"] = None  # the Engine's front end is a thread of the bench process
    print(f"  {row['completed']}/{len(reqs)} done in {elapsed:.1f} s, {row['output_throughput']:.1f} out tok/s, "
          f"retracted {row['counters'].get('num_retracted_reqs')}, accounting ok {row['accounting'].get('ok')}, "
          f"CPU s: bench process {row['cpu_s']['bench_process']:.1f}, server front end "
          f"{_fmt(row['cpu_s']['front_end'], '.1f')}, scheduler + detokenizer "
          f"{_fmt(row['cpu_s']['scheduler_and_detokenizer'], '.1f')}",
          file=sys.stderr, flush=True)  # fmt: skip
    return row


def _fmt(value, spec: str = ".0f", scale: float = 1.0) -> str:
    if value is None:
        return "–"
    return format(value * scale if scale != 1.0 else value, spec)


def _ms(d: dict, keys=("p50", "p90", "p99")) -> str:
    return " / ".join(_fmt(d.get(k), ".0f", 1000) for k in keys)


def _config(r: dict) -> str:
    parts = [r.get("request_set") or ""]
    if r.get("dtype"):
        parts.append({"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(r["dtype"], r["dtype"]))
    if r.get("mixed_chunk"):
        parts.append(f"mixed {r['mixed_chunk']}")
    if r.get("shared_prefix"):
        parts.append(f"shared-prefix attention {r['shared_prefix']}")
    return ", ".join(p for p in parts if p)


def _accounting_cell(acc: dict | None) -> str:
    if not acc or acc.get("ok") is None:
        return "–"
    text = "0 leaked" if acc["ok"] else f"**{acc['leaked']:+d}**"
    return (
        text if acc.get("protected_zero_when_idle", True) else f"{text}, {acc['protected_tokens']} protected"
    )


def load_table(rows: list[dict]) -> list[str]:
    rows = [r for r in rows if r["target"] == "server"]
    if not rows:
        return []
    lines = [
        "| config | offered (req/s) | × sat. | done | req/s | out tok/s | TTFT p50 / p90 / p99 (ms) | p99/p50 | "
        "TPOT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) | queue mean / p99 (ms) | retracted | cached tok "
        "| accounting |",
        "|---|---:|---:|---:|---:|---:|---|---:|---|---|---|---:|---:|---|",
    ]
    for r in rows:
        offered = "all at once" if r["request_rate"] == INF else f"{r['request_rate']:.2f}"
        if r.get("scenario") == "overload":
            offered += " (overload)"
        frac = _fmt(r.get("rate_fraction"), ".2f") if r["request_rate"] != INF else "–"
        q = r.get("queue_time_s") or {}
        queue = f"{_fmt(q.get('mean'), '.0f', 1000)} / {_fmt(q.get('p99'), '.0f', 1000)}"
        lines.append(
            f"| {_config(r)} | {offered} | {frac} | {r['completed']}/{r['completed'] + r['failed']} | "
            f"{r['request_throughput']:.2f} | {r['output_throughput']:.1f} | {_ms(r['ttft_s'])} | "
            f"{_fmt(r.get('ttft_p99_over_p50'), '.2f')} | {_ms(r['tpot_s'])} | {_ms(r['itl_s'])} | {queue} | "
            f"{_fmt(r['counters'].get('num_retracted_reqs'), 'd')} | {r['cached_tokens']} | "
            f"{_accounting_cell(r.get('accounting'))} |"
        )
    return lines


def offline_table(rows: list[dict]) -> list[str]:
    pairs = [(r, r["offline"]) for r in rows if r["target"] == "server" and r.get("offline")]
    if not pairs:
        return []
    lines = [
        "| config | requests | pool / demand (tok) | server out tok/s | Engine out tok/s | server / Engine | "
        "TTFT p50 / p99 server (s) | TTFT p50 / p99 Engine (s) | retracted server / Engine | "
        "cached tok server / Engine | accounting server / Engine |",
        "|---|---:|---|---:|---:|---:|---|---|---|---|---|",
    ]
    for s, o in pairs:
        n = s["completed"] + s["failed"]
        cap = f", ≤{s['max_concurrency']} concurrent" if s.get("max_concurrency") else ""
        pool = f"{_fmt(s.get('max_total_tokens'), 'd')} / {_fmt(s.get('demand_tokens'), 'd')}"

        def ttft(r: dict) -> str:
            return f"{_fmt(r['ttft_s']['p50'], '.2f')} / {_fmt(r['ttft_s']['p99'], '.2f')}"

        lines.append(
            f"| {_config(s)} | {s['completed']}/{n}{cap} | {pool} | {s['output_throughput']:.1f} | "
            f"{o['output_throughput']:.1f} | **{_fmt(s.get('server_over_offline'), '.2f')}** | {ttft(s)} | "
            f"{ttft(o)} | {_fmt(s['counters'].get('num_retracted_reqs'), 'd')} / "
            f"{_fmt(o['counters'].get('num_retracted_reqs'), 'd')} | {s['cached_tokens']} / {o['cached_tokens']} | "
            f"{_accounting_cell(s.get('accounting'))} / {_accounting_cell(o.get('accounting'))} |"
        )
    return lines


def target_checks(rows: list[dict]) -> list[dict]:
    """The load benchmark's targets, each with the row it is judged on: under the overload the
    server's output throughput >= 90% of the Engine's on the same requests and zero tokens leaked;
    a dataset run (W1, W2) through the server >= 95% of the Engine; p99 TTFT <= 3x p50 at 80% of
    the saturation rate."""
    checks = []
    for r in rows:
        if r["target"] != "server":
            continue
        where = _config(r)
        ratio = r.get("server_over_offline")
        if r.get("scenario") == "overload" and ratio is not None:
            leaked = [
                x.get("leaked")
                for x in (r.get("accounting"), (r.get("offline") or {}).get("accounting"))
                if x
            ]
            checks.append({"check": "overload: server / Engine output tok/s >= 0.90", "where": where,
                           "value": ratio, "pass": ratio >= 0.90})  # fmt: skip
            checks.append({"check": "overload: zero tokens leaked (server, Engine)", "where": where,
                           "value": leaked, "pass": bool(leaked) and all(x == 0 for x in leaked)})  # fmt: skip
        elif r.get("scenario") == "rate" and ratio is not None and r["request_rate"] == INF:
            checks.append({"check": "server / Engine output tok/s >= 0.95", "where": where, "value": ratio,
                           "pass": ratio >= 0.95})  # fmt: skip
        if r.get("rate_fraction") is not None and abs(r["rate_fraction"] - 0.8) < 1e-9:
            value = r.get("ttft_p99_over_p50")
            checks.append({"check": "TTFT p99 / p50 <= 3 at 0.8 x saturation", "where": where, "value": value,
                           "pass": value is not None and value <= 3.0})  # fmt: skip
    return checks


def machine_line(meta: dict) -> str:
    cpu = meta["cpu"]
    loads = [x for r in meta.get("load_averages", []) for x in r]
    load = f"{min(loads):.1f}–{max(loads):.1f}" if loads else "?"
    return (
        f"Machine: {cpu['model']} ({meta['cpu_count']} vCPUs; {', '.join(cpu['isa_flags']) or 'no listed ISA flags'}; "
        f"bf16 arithmetic: {'yes' if cpu['bf16_arithmetic'] else 'no'}), torch {meta['torch']}, "
        f"{meta.get('threads', '?')} intra-op threads, 1-min load average {load} across the runs, commit {meta['git_commit']}."
    )


def print_report(data: dict, markdown: bool) -> None:
    meta, rows = data["meta"], data["rows"]
    if markdown:
        print("Command, from the repository root:\n\n```\n" + meta["command"] + "\n```\n")
        print(machine_line(meta))
        for s in data.get("skipped", []):
            print(f"Skipped: {s['dtype']}: {s['reason']}.")
        print()
    for table in (load_table(rows), offline_table(rows)):
        if table:
            print("\n".join(table) + "\n")
    for c in target_checks(rows):
        value = c["value"] if isinstance(c["value"], list) else _fmt(c["value"], ".2f")
        print(f"- {c['check']} ({c['where']}): {value}, {'pass' if c['pass'] else '**FAIL**'}")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r["target"] == "server" and r.get("scenario") in ("rate", "sweep", "saturation"):
            groups.setdefault(_config(r) or "server", []).append(r)
    if not groups:
        print("no load-sweep rows to plot (--request-rates or --saturation)", file=sys.stderr)
        plt.close(fig)
        return
    for i, (name, rs) in enumerate(groups.items()):
        color = f"C{i}"
        finite = sorted((r for r in rs if r["request_rate"] != INF), key=lambda r: r["request_rate"])
        xs = [r["request_rate"] for r in finite]
        ax_tp.plot(xs, [r["output_throughput"] for r in finite], "o-", color=color, label=name)
        ax_ttft.plot(xs, [r["ttft_s"]["p99"] for r in finite], "o-", color=color, label=f"{name}, p99")
        ax_ttft.plot(
            xs, [r["ttft_s"]["p50"] for r in finite], "o:", color=color, alpha=0.6, label=f"{name}, p50"
        )
        for r in rs:
            if r["request_rate"] == INF:  # the saturation run: at its own completed req/s
                ax_tp.plot(
                    [r["request_throughput"]], [r["output_throughput"]], "*", color=color, markersize=12
                )
                ax_tp.axvline(r["request_throughput"], color=color, linestyle="--", alpha=0.4)
                ax_ttft.axvline(r["request_throughput"], color=color, linestyle="--", alpha=0.4)
    ax_tp.set(xlabel="offered rate (req/s)", ylabel="output throughput (tok/s)", title="Throughput")
    ax_ttft.set(xlabel="offered rate (req/s)", ylabel="TTFT (s)", title="Time to first token", yscale="log")
    for ax in (ax_tp, ax_ttft):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("bench_serving: Poisson arrivals (dashed: saturation rate, ★: all at once)", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


# Machine --------------------------------------------------------------------------------------


def cpu_info() -> dict:
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {
        "model": model,
        "isa_flags": [f for f in ISA_FLAGS if f in flags],
        "bf16_arithmetic": bool({"avx512_bf16", "amx_bf16"} & flags),
        "num_flags": len(flags),
    }


def _git_commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True)  # fmt: skip
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def machine_meta(args) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "unknown"
    return {
        "command": shlex.join([os.path.relpath(sys.executable, REPO)] + sys.argv),
        "argv": sys.argv,
        "time": time.ctime(),
        "cpu": cpu_info(),
        "cpu_count": os.cpu_count(),
        "torch": torch_version,
        "git_commit": _git_commit(),
        "load_average_start": os.getloadavg(),
    }


# Server ---------------------------------------------------------------------------------------


def launch(server_flags: list[str], port: int, log_path: Path | None = None) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "radixengine.launch_server", "--port", str(port), "--log-level", "warning",
        "--enable-metrics",
    ]  # fmt: skip
    out = None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "w")
    proc = subprocess.Popen(
        cmd + server_flags, cwd=REPO, stdout=out, stderr=subprocess.STDOUT if out else None
    )
    if out is not None:
        out.close()  # the server holds its own handle
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text()[-3000:] if log_path else ""
            raise RuntimeError(f"the server exited with code {proc.returncode}\n{tail}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError("the server did not become ready")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def server_args_from_flags(flags: list[str]):
    """The ServerArgs the launched server gets from these flags (for the offline Engine)."""
    from radixengine.launch_server import parse_args as parse_server_args

    return parse_server_args(flags)


def server_args_from_info(info: dict):
    """ServerArgs of a running server from its get_server_info (the --base-url case)."""
    from radixengine.server_args import ServerArgs

    names = {f.name for f in dataclasses.fields(ServerArgs)} - {"extra"}
    kwargs = {k: v for k, v in info.items() if k in names}
    # get_server_info overlays the scheduler's state on the arguments: max_total_tokens and
    # max_running_requests come back as the values the server derived (so the Engine gets the same
    # pool), the rest as given.
    return ServerArgs(**kwargs)


def non_default_server_args(info: dict) -> dict:
    """The server's arguments that differ from ServerArgs' defaults, as it reports them (the pool
    size and running-request cap are the values it derived)."""
    from radixengine.server_args import ServerArgs

    out = {}
    for f in dataclasses.fields(ServerArgs):
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.name in info and info[f.name] != default and f.name not in ("port", "extra"):
            out[f.name] = info[f.name]
    return out


def _log_problems(path: Path | None) -> dict:
    if path is None or not path.exists():
        return {}
    text = path.read_text(errors="replace")
    return {
        "token_accounting_errors": text.count("token accounting broken"),
        "tracebacks": text.count("Traceback"),
    }


# Main -----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--base-url", default=None, help="a running server (default: launch one per configuration)"
    )
    p.add_argument(
        "--launch",
        action="store_true",
        help="start `radixengine.launch_server` (the default; kept for old command lines)",
    )
    p.add_argument(
        "--server-flags", default="", help="flags for the launched server (and the offline Engine)"
    )
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--dataset", default=None, help="JSONL prompts (messages or text), a comma list; default: generated"
    )
    p.add_argument("--dataset-name", choices=("random", "shared-prefix"), default="shared-prefix")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=192, help="shared-prefix: tokens in the common prefix")
    p.add_argument("--max-tokens", type=int, default=None, help="override a dataset's max_new_tokens")
    p.add_argument("--limit", type=int, default=None, help="first N requests of each dataset (smoke runs)")
    p.add_argument(
        "--request-rates",
        default=None,
        help="comma list of req/s; inf = all at once (default 1,2,4 unless --saturation or --overload)",
    )
    p.add_argument("--saturation", action="store_true",
                   help="first all requests at once (the saturation rate: its completed req/s), then Poisson "
                   "arrivals at --rate-fractions of it")  # fmt: skip
    p.add_argument("--rate-fractions", default="0.25,0.5,0.8,1.0,1.5")
    p.add_argument("--saturation-rate", type=float, default=None,
                   help="use this saturation rate (req/s) instead of measuring it")  # fmt: skip
    p.add_argument("--overload", type=int, default=None, metavar="N",
                   help="N generated requests all at once (pool smaller than their demand: set "
                   "--max-total-tokens in --server-flags), then the same through the offline Engine")  # fmt: skip
    p.add_argument("--offline", action="store_true",
                   help="also run every all-at-once (inf) run's requests through the offline Engine")  # fmt: skip
    p.add_argument(
        "--mixed-chunk", default="", help="comma list of on, off: the server's --enable-mixed-chunk"
    )
    p.add_argument(
        "--shared-prefix",
        default="",
        help="comma list of on, off: the server's shared-prefix attention (off: --disable-shared-prefix-attention)",
    )
    p.add_argument("--dtypes", default="", help="comma list of --dtype values, one configuration each")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=str(REPO / "bench_results" / "bench_serving.json"))
    p.add_argument(
        "--plot", default=None, metavar="FILE.png", help="throughput and TTFT against the offered rate"
    )
    p.add_argument(
        "--markdown", action="store_true", help="print paste-ready tables with the command and machine"
    )
    p.add_argument(
        "--from-json", default=None, help="print tables / plot from a saved run instead of running"
    )
    args = p.parse_args(argv)
    args.mixed_chunk = [x for x in args.mixed_chunk.split(",") if x]
    if set(args.mixed_chunk) - {"on", "off"}:
        p.error("--mixed-chunk takes a comma list of on, off")
    args.shared_prefix = [x for x in args.shared_prefix.split(",") if x]
    if set(args.shared_prefix) - {"on", "off"}:
        p.error("--shared-prefix takes a comma list of on, off")
    args.dtypes = [x for x in args.dtypes.split(",") if x]
    args.server_flag_list = shlex.split(args.server_flags)
    if args.mixed_chunk and "--enable-mixed-chunk" in args.server_flag_list:
        p.error("give --enable-mixed-chunk through --mixed-chunk, not --server-flags")
    if args.base_url and (args.mixed_chunk or args.shared_prefix or args.dtypes or args.server_flags):
        p.error(
            "--mixed-chunk, --shared-prefix, --dtypes and --server-flags need a launched server (no --base-url)"
        )
    if args.overload is not None and args.overload < 1:
        p.error("--overload takes a positive number of requests")
    if args.request_rates is None and not args.saturation and args.overload is None:
        args.request_rates = "1,2,4"
    args.rates = [float(x) for x in args.request_rates.split(",")] if args.request_rates else []
    args.fractions = [float(x) for x in args.rate_fractions.split(",") if x]
    return args


def plan_configs(args) -> list[dict]:
    """(dtype, mixed chunk) configurations and their server flags."""
    base = args.server_flag_list
    server_args_from_flags(base)  # rejects bad flags before anything starts
    configs = []
    for dtype in args.dtypes or [None]:
        for mixed in args.mixed_chunk or [None]:
            for shared in args.shared_prefix or [None]:
                flags = (
                    list(base)
                    + (["--dtype", dtype] if dtype else [])
                    + (["--enable-mixed-chunk"] if mixed == "on" else [])
                    + (["--disable-shared-prefix-attention"] if shared == "off" else [])
                )
                configs.append(
                    {"dtype": dtype, "mixed_chunk": mixed, "shared_prefix": shared, "server_flags": flags}
                )
    return configs


def run_config(args, cfg: dict, meta: dict) -> list[dict]:
    """Every scenario against one server (launched with cfg's flags), then the paired offline runs."""
    proc = log_path = None
    base_url = args.base_url
    tag = "-".join(
        str(v)
        for v in (
            cfg["dtype"],
            cfg["mixed_chunk"] and f"mixed-{cfg['mixed_chunk']}",
            cfg["shared_prefix"] and f"shared-prefix-{cfg['shared_prefix']}",
        )
        if v
    )
    if base_url is None:
        from radixengine.utils.network import get_free_port

        port = get_free_port()
        log_path = Path(args.output).with_suffix(f".server{'-' + tag if tag else ''}.log")
        print(f"launching the server: {shlex.join(cfg['server_flags'])} (log {log_path})", file=sys.stderr)
        proc = launch(cfg["server_flags"], port, log_path)
        base_url = f"http://127.0.0.1:{port}"
    labels = {
        "dtype": cfg["dtype"],
        "mixed_chunk": cfg["mixed_chunk"],
        "shared_prefix": cfg["shared_prefix"],
        "server_flags": cfg["server_flags"],
    }
    rows, offline_todo = [], []
    try:
        server = ServerTarget(base_url, args.api_key, proc.pid if proc is not None else None)
        info = server.info()
        model = httpx.get(f"{base_url}/v1/models", headers=server.headers).json()["data"][0]["id"]
        meta["threads"] = info.get("num_threads") or os.cpu_count()
        cfg["engine_args"] = (server_args_from_flags(cfg["server_flags"]) if proc is not None
                              else server_args_from_info(info))  # fmt: skip
        vocab = int(info.get("vocab_size") or 32000)
        labels["server_args"] = non_default_server_args(info)
        sets = []
        if args.dataset:
            for path in args.dataset.split(","):
                sets.append((Path(path).stem, load_dataset(path, model, args.max_tokens)[: args.limit]))
        elif args.rates or args.saturation:
            name = f"{args.dataset_name} {args.input_len}/{args.output_len}"
            sets.append((name, generate_prompts(args.dataset_name, args.num_prompts, args.input_len, args.output_len,
                                                args.prefix_len, model, vocab, args.seed)))  # fmt: skip
        server.warmup(model)
        for set_name, reqs in sets:
            set_labels = {**labels, "request_set": set_name}
            sat = None
            if args.saturation:
                sat = args.saturation_rate
                if sat is None:
                    row = measure(server, reqs, INF, args, scenario="saturation", **set_labels)
                    rows.append(row)
                    offline_todo.append((row, reqs))
                    sat = row["request_throughput"]
                plan = [(f * sat, f) for f in args.fractions]
            else:
                plan = [(rate, None) for rate in args.rates]
            for rate, frac in plan:
                row = measure(server, reqs, rate, args, scenario="sweep" if args.saturation else "rate",
                              rate_fraction=frac, saturation_rate=sat, **set_labels)  # fmt: skip
                rows.append(row)
                if rate == INF:
                    offline_todo.append((row, reqs))
        if args.overload is not None:
            name = f"overload {args.overload} × {args.dataset_name} {args.input_len}/{args.output_len}"
            reqs = generate_prompts(args.dataset_name, args.overload, args.input_len, args.output_len,
                                    args.prefix_len, model, vocab, args.seed)  # fmt: skip
            demand = sum(len(r.body["prompt"]) + r.body["max_tokens"] for r in reqs)
            if info.get("max_total_tokens") and info["max_total_tokens"] >= demand:
                print(f"warning: the pool ({info['max_total_tokens']} tokens) holds the whole demand ({demand}); "
                      "lower --max-total-tokens for an overload", file=sys.stderr)  # fmt: skip
            concurrency, args.max_concurrency = args.max_concurrency, None
            try:
                row = measure(server, reqs, INF, args, scenario="overload", request_set=name, **labels)
            finally:
                args.max_concurrency = concurrency
            rows.append(row)
            offline_todo.append((row, reqs))
    finally:
        if proc is not None:
            stop(proc)
    problems = _log_problems(log_path)
    for row in rows:
        row["server_log"] = str(log_path) if log_path else None
        row["server_log_problems"] = problems
    if args.offline or args.overload is not None:
        todo = [(r, q) for r, q in offline_todo if args.offline or r["scenario"] == "overload"]
        rows += run_offline(args, cfg, labels, todo)
    return rows


def run_offline(args, cfg: dict, labels: dict, todo: list[tuple[dict, list[Request]]]) -> list[dict]:
    if not todo:
        return []
    from radixengine import Engine

    engine_args = dataclasses.replace(cfg["engine_args"], log_level="warning", enable_metrics=True)
    print(f"offline Engine ({shlex.join(cfg['server_flags'])}) ...", file=sys.stderr, flush=True)
    rows = []
    with Engine(server_args=engine_args) as engine:
        target = EngineTarget(engine)
        target.warmup("")
        for server_row, reqs in todo:
            concurrency, args.max_concurrency = args.max_concurrency, server_row["max_concurrency"]
            try:
                row = measure(target, reqs, INF, args, scenario=server_row["scenario"],
                              request_set=server_row["request_set"], **labels)  # fmt: skip
            finally:
                args.max_concurrency = concurrency
            ratio = (
                server_row["output_throughput"] / row["output_throughput"]
                if row["output_throughput"]
                else None
            )
            server_row["server_over_offline"] = row["server_over_offline"] = ratio
            server_row["same_prompt_tokens_as_offline"] = server_row["prompt_tokens"] == row["prompt_tokens"]
            server_row["offline"] = {k: row[k] for k in ("output_throughput", "request_throughput", "duration_s",
                                                         "prompt_tokens", "output_tokens", "cached_tokens",
                                                         "ttft_s", "counters", "accounting")}  # fmt: skip
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        data["rows"] = [_restore_inf(r) for r in data["rows"]]
        print_report(data, args.markdown)
        if args.plot:
            plot(data["rows"], args.plot)
        return
    meta = machine_meta(args)
    configs = plan_configs(args)
    data = {"meta": meta, "definitions": DEFINITIONS, "rows": []}
    for cfg in configs:
        data["rows"] += run_config(args, cfg, meta)
        meta["load_averages"] = [
            r[k] for r in data["rows"] for k in ("load_average_before", "load_average_after")
        ]
        meta["load_average_end"] = os.getloadavg()
        data["targets"] = target_checks(data["rows"])
        _write(args.output, data)  # after each configuration: a long run keeps what it has
    print_report(data, args.markdown)
    if args.plot:
        plot(data["rows"], args.plot)
    print(f"wrote {args.output}", file=sys.stderr)


def _write(path: str, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)


def _restore_inf(row: dict) -> dict:
    # json writes inf as Infinity, which json.loads reads back; strings only from older files
    if isinstance(row.get("request_rate"), str):
        row["request_rate"] = float(row["request_rate"])
    return row


if __name__ == "__main__":
    main()
