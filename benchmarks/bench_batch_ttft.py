"""Interactive TTFT with and without a running /v1/batches batch.

    python benchmarks/bench_batch_ttft.py                          # the default model, on this machine
    python benchmarks/bench_batch_ttft.py --batch-lines 1000 --interactive 30 -- --num-threads 2

Starts the real server (`python -m radixengine.launch_server`, the flags after `--` added) once
per configuration and measures the same interactive load in three phases: `--interactive`
streaming chat requests, one at a time with `--gap` seconds between them (`max_tokens`
`--interactive-tokens`), TTFT = the time to the first content chunk; first alone, then while a
`--batch-lines`-line batch over /v1/chat/completions (distinct prompts, `--batch-tokens` tokens
each) runs at its lowest priority, `--batch-max-running` lines in the engine at once, then alone
again once the batch is cancelled. Configurations:
- `default`: the interactive requests carry no priority (they tie with the batch's lowest value);
- `priority`: `--enable-priority-scheduling`, the interactive requests at priority 0 (above the
  batch's: they go first and may preempt batch lines).
Prints one JSON line per phase: TTFT p50 / p90 / max, e2e p50, and the batch lines finished
during it."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from test_engine_utils import launch_test_server, stop_test_server  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while seven small models answer questions".split()


def batch_file(lines: int, tokens: int) -> bytes:
    out = []
    for i in range(lines):
        words = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(12))
        body = {"messages": [{"role": "user", "content": f"Request {i}: {words}"}], "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        out.append(
            json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
        )
    return ("\n".join(out) + "\n").encode()


def start_batch(base: str, args: argparse.Namespace) -> str:
    files = {"file": ("batch.jsonl", batch_file(args.batch_lines, args.batch_tokens))}
    upload = httpx.post(base + "/v1/files", files=files, data={"purpose": "batch"}, timeout=60).json()
    body = {"input_file_id": upload["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    batch = httpx.post(base + "/v1/batches", json=body, timeout=60).json()
    while get_batch(base, batch["id"])["request_counts"]["completed"] < args.batch_max_running:
        time.sleep(0.2)  # the batch is running at full width
    return batch["id"]


def get_batch(base: str, batch_id: str) -> dict:
    return httpx.get(f"{base}/v1/batches/{batch_id}", timeout=60).json()


def interactive(base: str, args: argparse.Namespace, priority: int | None) -> tuple[list[float], list[float]]:
    ttfts, e2es = [], []
    for i in range(args.interactive):
        body = {"messages": [{"role": "user", "content": f"Interactive question {i}: what is a radix tree?"}],
                "max_tokens": args.interactive_tokens, "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        if priority is not None:
            body["priority"] = priority
        start, first = time.perf_counter(), None
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if first is None and line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                    if json.loads(line[6:])["choices"][0]["delta"].get("content"):
                        first = time.perf_counter()
        ttfts.append(first - start)
        e2es.append(time.perf_counter() - start)
        time.sleep(args.gap)
    return ttfts, e2es


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def run_config(priority: bool, args: argparse.Namespace, root: Path) -> list[dict]:
    """One server; the interactive load alone, under the batch, and alone again once the batch is
    cancelled (the two alone runs bracket the batch run, against drift on a shared machine)."""
    name = "priority" if priority else "default"
    flags = [
        "--batch-dir",
        str(root / name),
        "--batch-max-running",
        str(args.batch_max_running),
        *args.server_flags,
    ]
    if priority:
        flags.append("--enable-priority-scheduling")
    server = launch_test_server(args.model_path or _default_model(), root / f"{name}.log", flags, timeout=600)
    try:
        base = server.base_url
        interactive(base, argparse.Namespace(**{**vars(args), "interactive": 2, "gap": 0}), None)  # warm-up
        rows = [measure(base, args, f"{name}: alone", None, None)]
        batch_id = start_batch(base, args)
        rows.append(measure(base, args, f"{name}: under the batch", batch_id, 0 if priority else None))
        httpx.post(f"{base}/v1/batches/{batch_id}/cancel", timeout=60)
        while get_batch(base, batch_id)["status"] != "cancelled":
            time.sleep(0.2)
        rows.append(measure(base, args, f"{name}: alone again", None, None))
        return rows
    finally:
        stop_test_server(server)


def measure(
    base: str, args: argparse.Namespace, phase: str, batch_id: str | None, priority: int | None
) -> dict:
    done_before = get_batch(base, batch_id)["request_counts"]["completed"] if batch_id else 0
    start = time.perf_counter()
    ttfts, e2es = interactive(base, args, priority)
    elapsed = time.perf_counter() - start
    done = get_batch(base, batch_id)["request_counts"]["completed"] - done_before if batch_id else 0
    row = {"phase": phase, "ttft_p50_s": round(statistics.median(ttfts), 4), "ttft_p90_s": round(pct(ttfts, 0.9), 4),
           "ttft_max_s": round(max(ttfts), 4), "e2e_p50_s": round(statistics.median(e2es), 4),
           "interactive": len(ttfts), "batch_lines_done_meanwhile": done, "seconds": round(elapsed, 1)}  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def _default_model() -> str:
    from radixengine.model_loader import default_model_path

    return default_model_path()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="default: the bundled SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--configs", default="default,priority", help="default and/or priority")
    parser.add_argument("--batch-lines", type=int, default=1000)
    parser.add_argument("--batch-tokens", type=int, default=64)
    parser.add_argument("--batch-max-running", type=int, default=16)
    parser.add_argument("--interactive", type=int, default=20)
    parser.add_argument("--interactive-tokens", type=int, default=16)
    parser.add_argument("--gap", type=float, default=0.5)
    parser.add_argument("server_flags", nargs="*", help="flags for the server, after --")
    args = parser.parse_args()
    print(json.dumps({"git": _git_head(), "args": vars(args)}))
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs.split(","):
            run_config(config == "priority", args, Path(tmp))


def _git_head() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()


if __name__ == "__main__":
    main()
