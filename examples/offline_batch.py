"""Offline batch generation: a JSONL of prompts in, a JSONL of results out (in input order).

    python examples/offline_batch.py                       # the sample prompts, the default model
    python examples/offline_batch.py --input prompts.jsonl --output results.jsonl --schedule-policy lpm

Each input line is a JSON object with one of `text` (or `prompt`), `messages` (chat, rendered with
the model's chat template) or `input_ids`, and optionally `sampling_params` (SGLang's fields) and
`id` (copied to the result). A malformed line is reported with its line number and skipped; the
rest of the file still runs. A request the engine refuses gets a result with `error`. All requests
go to the engine at once, so that the scheduler sees the whole batch (and shares common prefixes).
Every server flag (`--model-path`, `--schedule-policy`, `--dtype`, ...) is accepted."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from tqdm import tqdm

from radixengine.server_args import ServerArgs

SAMPLE_INPUT = Path(__file__).with_name("prompts.jsonl")
PROMPT_KEYS = ("text", "prompt", "messages", "input_ids")


@dataclasses.dataclass
class Item:
    line: int
    request: dict  # kwargs of Engine.async_generate
    id: object = None


def parse_line(raw: str, line: int, defaults: dict) -> Item:
    """One JSONL line → an Item; raises ValueError with the reason when malformed."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    given = [k for k in PROMPT_KEYS if k in obj]
    if len(given) != 1:
        raise ValueError(f"needs exactly one of {', '.join(PROMPT_KEYS)}")
    key = given[0]
    value = obj[key]
    if key in ("text", "prompt") and not isinstance(value, str):
        raise ValueError(f"{key} must be a string")
    if key == "messages" and not (isinstance(value, list) and all(isinstance(m, dict) for m in value)):
        raise ValueError("messages must be a list of objects")
    if key == "input_ids" and not (isinstance(value, list) and all(isinstance(t, int) for t in value)):
        raise ValueError("input_ids must be a list of integers")
    params = obj.get("sampling_params")
    params = {} if params is None else params  # null: the defaults, as on HTTP and in Engine
    if not isinstance(params, dict):
        raise ValueError("sampling_params must be an object")
    request = {
        "prompt" if key in ("text", "prompt") else key: value,
        "sampling_params": {**defaults, **params},
    }
    return Item(line, request, obj.get("id"))


def read_items(path: str, defaults: dict) -> tuple[list[Item], list[tuple[int, str]]]:
    items, bad = [], []
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                items.append(parse_line(raw, n, defaults))
            except ValueError as e:
                bad.append((n, str(e)))
    return items, bad


async def run_all(engine, items: list[Item]) -> list[dict]:
    """Submit everything at once; update the progress bar as requests finish."""
    results: list[dict | None] = [None] * len(items)
    start = time.perf_counter()
    out_tokens = 0

    async def one(i: int) -> int:
        try:
            results[i] = await engine.async_generate(**items[i].request)
        except Exception as e:  # refused by the engine: keep its place in the output
            results[i] = {"error": str(e)}
        return i

    bar = tqdm(total=len(items), unit="req", desc="generating", file=sys.stderr)
    for done in asyncio.as_completed([one(i) for i in range(len(items))]):
        i = await done
        out_tokens += results[i].get("meta_info", {}).get("completion_tokens", 0)
        bar.set_postfix_str(f"{out_tokens / (time.perf_counter() - start):.1f} tok/s")
        bar.update(1)
    bar.close()
    return results


def write_results(path: str, items: list[Item], results: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for item, res in zip(items, results):
            record = {"line": item.line}
            if item.id is not None:
                record["id"] = item.id
            record.update(res)
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def summarize(results: list[dict], elapsed: float, num_bad: int) -> dict:
    ok = [r for r in results if "error" not in r]
    prompt = sum(r["meta_info"]["prompt_tokens"] for r in ok)
    cached = sum(r["meta_info"]["cached_tokens"] for r in ok)
    completion = sum(r["meta_info"]["completion_tokens"] for r in ok)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "malformed_lines": num_bad,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": completion,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "elapsed_s": elapsed,
        "output_tokens_per_s": completion / elapsed if elapsed else 0.0,
        "total_tokens_per_s": (prompt + completion) / elapsed if elapsed else 0.0,
    }


def positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return n


def check_paths(input_path: str, output_path: str) -> str | None:
    """Why the input cannot be read or the output cannot be written (None: both fine); creates the
    output's parent directories, so that a long batch is not lost at the end."""
    if not os.path.exists(input_path):
        return f"--input {input_path}: no such file"
    if not os.path.isfile(input_path):
        return f"--input {input_path}: not a file"
    if not os.access(input_path, os.R_OK):
        return f"--input {input_path}: not readable"
    if os.path.isdir(output_path):
        return f"--output {output_path}: is a directory"
    parent = os.path.dirname(os.path.abspath(output_path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        return f"--output {output_path}: cannot create its directory {parent} ({e.strerror})"
    if not os.access(parent, os.W_OK):
        return f"--output {output_path}: its directory {parent} is not writable"
    return None


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, ServerArgs]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", default=str(SAMPLE_INPUT), help="JSONL of prompts (default: the sample)")
    parser.add_argument(
        "--output",
        default="offline_batch_output.jsonl",
        help="JSONL of results (its parent directories are created)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=None,
        help="max_new_tokens of the lines whose sampling_params do not give their own (default: the engine's)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="temperature of the lines whose sampling_params do not give their own (default: the engine's)",
    )
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        server_args = ServerArgs.from_cli_args(args)
    except ValueError as e:
        parser.error(str(e))
    problem = check_paths(args.input, args.output)
    if problem is not None:
        parser.error(problem)
    return args, server_args


def main(argv: list[str] | None = None) -> int:
    args, server_args = parse_args(argv)
    defaults = {
        k: v
        for k, v in (("max_new_tokens", args.max_new_tokens), ("temperature", args.temperature))
        if v is not None
    }
    items, bad = read_items(args.input, defaults)
    for n, why in bad:
        print(f"{args.input}:{n}: skipped malformed line: {why}", file=sys.stderr)
    if not items:
        print("no valid request in the input", file=sys.stderr)
        return 1

    from radixengine import Engine

    with Engine(server_args=server_args) as engine:
        start = time.perf_counter()
        results = asyncio.run(run_all(engine, items))
        elapsed = time.perf_counter() - start
    write_results(args.output, items, results)
    for item, res in zip(items, results):
        if "error" in res:
            print(f"{args.input}:{item.line}: request failed: {res['error']}", file=sys.stderr)
    summary = summarize(results, elapsed, len(bad))
    print(json.dumps(summary, indent=2))
    print(f"wrote {len(results)} results to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
