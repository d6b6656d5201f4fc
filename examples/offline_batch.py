"""Offline batch generation: a JSONL of prompts in, a JSONL of results out (in input order).

    python examples/offline_batch.py                       # the sample prompts, the default model
    python examples/offline_batch.py --input prompts.jsonl --output results.jsonl --schedule-policy lpm
    python examples/offline_batch.py --input batch.jsonl --output out.jsonl --resume   # after a kill

Each input line is a JSON object in one of two formats:
- this script's own: one of `text` (or `prompt`), `messages` (chat, rendered with the model's chat
  template) or `input_ids`, and optionally `sampling_params` (SGLang's fields) and `id` (copied
  to the result); its result is the engine's output (`text`, `output_ids`, `meta_info`).
- OpenAI's batch input (as vLLM's run_batch reads it): `custom_id`, `method` POST, `url`
  `/v1/chat/completions` or `/v1/completions`, `body`; its result is OpenAI's batch output line
  (`id`, `custom_id`, `response` with `status_code`, `request_id` and `body`, `error`).
Every result also carries `line` (its input line number).

The input is JSON Lines as OpenAI and vLLM read it: a line ends at `\\n` only (not at the U+2028,
U+2029 or U+0085 a JSON string may hold raw). A malformed line (not UTF-8, not JSON, a
`custom_id` or `id` an earlier line has) is reported with its line number and skipped; the rest
of the file still runs.
A request the engine refuses gets a result with `error` (OpenAI format: a `response` with its
status code and error body). All requests go to the engine at once, so that the scheduler sees
the whole batch (and shares common prefixes). Each result is appended to the output and flushed
the moment it finishes, so a run killed midway keeps everything finished; at the end the file is
rewritten in input order. `--resume` keeps the results already in the output and runs only the
lines without one (a line is known by its `custom_id`, else its `id`, else its line number: resume
with the same input file); the final file is then the one an uninterrupted run writes (greedy),
but for what differs between any two runs (request ids, latencies, `created`, cached tokens).
Every server flag (`--model-path`, `--schedule-policy`, `--dtype`, ...) is accepted."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
import uuid
from pathlib import Path

from tqdm import tqdm

from radixengine.server_args import ServerArgs
from radixengine.utils.jsonl import decode_line, numbered_lines

SAMPLE_INPUT = Path(__file__).with_name("prompts.jsonl")
PROMPT_KEYS = ("text", "prompt", "messages", "input_ids")
OPENAI_URLS = ("/v1/chat/completions", "/v1/completions")


@dataclasses.dataclass
class Item:
    line: int
    request: dict  # kwargs of Engine.async_generate; OpenAI's format: {"url", "body"}
    id: object = None
    custom_id: str | None = None  # set: a line of OpenAI's batch format

    @property
    def key(self) -> tuple:
        """What identifies the line's result in the output (for --resume)."""
        if self.custom_id is not None:
            return ("custom_id", self.custom_id)
        return ("id", json.dumps(self.id)) if self.id is not None else ("line", self.line)


def record_key(record: dict) -> tuple:
    if "custom_id" in record:
        return ("custom_id", record["custom_id"])
    return ("id", json.dumps(record["id"])) if "id" in record else ("line", record["line"])


def parse_line(raw: str, line: int, defaults: dict) -> Item:
    """One JSONL line → an Item; raises ValueError with the reason when malformed."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    if "custom_id" in obj:
        return parse_openai_line(obj, line, defaults)
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


def parse_openai_line(obj: dict, line: int, defaults: dict) -> Item:
    """A line of OpenAI's batch input; --max-new-tokens / --temperature fill the body's unset
    max_tokens / temperature."""
    if not isinstance(obj["custom_id"], str) or not obj["custom_id"]:
        raise ValueError("custom_id must be a non-empty string")
    if obj.get("method", "POST") != "POST":
        raise ValueError(f"method must be POST, got {obj.get('method')!r}")
    if obj.get("url") not in OPENAI_URLS:
        raise ValueError(f"url must be one of {', '.join(OPENAI_URLS)}, got {obj.get('url')!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise ValueError("body must be an object")
    fill = {"max_tokens": defaults.get("max_new_tokens"), "temperature": defaults.get("temperature")}
    body = {**{k: v for k, v in fill.items() if v is not None}, **body}
    return Item(line, {"url": obj["url"], "body": body}, custom_id=obj["custom_id"])


def read_items(path: str, defaults: dict) -> tuple[list[Item], list[tuple[int, str]]]:
    """The input's lines (JSON Lines: a line ends at \\n only) and the malformed ones, a line whose
    key (`custom_id`, else `id`) an earlier line has among them, as /v1/batches refuses it: its
    result could not be told from the first one's (nor skipped alone by --resume)."""
    items, bad, seen = [], [], set()
    with open(path, "rb") as f:
        for n, raw in numbered_lines(f):
            try:
                item = parse_line(decode_line(raw), n, defaults)
            except ValueError as e:
                bad.append((n, str(e)))
                continue
            if item.key in seen:
                name = repr(item.custom_id) if item.custom_id is not None else item.key[1]
                bad.append((n, f"{item.key[0]} {name} is not unique in the file"))
                continue
            seen.add(item.key)
            items.append(item)
    return items, bad


async def answer(engine, item: Item) -> dict:
    """The line's result record (a refusal included)."""
    if item.custom_id is None:
        try:
            result = await engine.async_generate(**item.request)
        except Exception as e:  # refused by the engine: keep its place in the output
            result = {"error": str(e)}
        record = {"line": item.line, **({"id": item.id} if item.id is not None else {})}
        return {**record, **result}
    rid = f"batch_req_{uuid.uuid4().hex}"
    try:
        body, status = await engine.async_openai(item.request["url"], item.request["body"]), 200
    except Exception as e:
        status = getattr(e, "status_code", 500)
        body = {"error": {"message": getattr(e, "message", str(e)), "type": getattr(e, "err_type", type(e).__name__),
                          "param": getattr(e, "param", None), "code": status}}  # fmt: skip
    response = {"status_code": status, "request_id": rid, "body": body}
    return {"line": item.line, "id": rid, "custom_id": item.custom_id, "response": response, "error": None}


async def run_all(engine, items: list[Item], out) -> int:
    """Submit everything at once; each result is appended to `out` and flushed as it finishes.
    Returns how many failed."""
    start = time.perf_counter()
    out_tokens = failed = 0

    bar = tqdm(total=len(items), unit="req", desc="generating", file=sys.stderr)
    for done in asyncio.as_completed([answer(engine, item) for item in items]):
        record = await done
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
        out.flush()
        if record_error(record) is not None:
            failed += 1
        out_tokens += record_usage(record)[2]
        bar.set_postfix_str(f"{out_tokens / (time.perf_counter() - start):.1f} tok/s")
        bar.update(1)
    bar.close()
    return failed


def record_error(record: dict) -> str | None:
    if "response" in record:
        status = record["response"]["status_code"]
        return None if status == 200 else record["response"]["body"]["error"]["message"]
    return record.get("error")


def record_usage(record: dict) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens of a successful record, else zeros."""
    if record_error(record) is not None:
        return 0, 0, 0
    if "response" in record:
        usage = record["response"]["body"]["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return usage["prompt_tokens"], cached, usage["completion_tokens"]
    meta = record["meta_info"]
    return meta["prompt_tokens"], meta["cached_tokens"], meta["completion_tokens"]


def read_done(path: str) -> set[tuple]:
    """The keys of the results already in `path`; a last line cut short by a kill is dropped."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb") as f:
        data = f.read()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        with open(path, "r+b") as f:
            f.truncate(len(whole))
    return {record_key(json.loads(line)) for _, line in numbered_lines(whole.split(b"\n"))}


def sort_output(path: str) -> list[dict]:
    """Rewrite `path` in input (`line`) order without holding the results in memory (an index
    of offsets, then one line at a time); returns the summary's per-record numbers."""
    index, stats = [], []
    with open(path, "rb") as f:
        offset = 0
        for raw in f:
            record = json.loads(raw)
            index.append((record["line"], offset, len(raw)))
            stats.append(
                {"error": record_error(record), "usage": record_usage(record), "line": record["line"]}
            )
            offset += len(raw)
    index.sort()
    tmp = path + ".tmp"
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        for _, offset, length in index:
            src.seek(offset)
            dst.write(src.read(length))
    os.replace(tmp, path)
    return sorted(stats, key=lambda s: s["line"])


def summarize(stats: list[dict], elapsed: float, num_bad: int, run: int) -> dict:
    ok = [s["usage"] for s in stats if s["error"] is None]
    prompt, cached, completion = (sum(u[k] for u in ok) for k in range(3))
    return {
        "requests": len(stats),
        "run_now": run,
        "failed": len(stats) - len(ok),
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
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the results already in --output and run only the lines without one",
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

    done = read_done(args.output) if args.resume else set()
    todo = [item for item in items if item.key not in done]
    if done:
        print(f"--resume: {len(items) - len(todo)} results already in {args.output}", file=sys.stderr)

    from radixengine import Engine

    start = time.perf_counter()
    with open(args.output, "a" if args.resume else "w", encoding="utf-8") as out:
        if todo:
            with Engine(server_args=server_args) as engine:
                asyncio.run(run_all(engine, todo, out))
    elapsed = time.perf_counter() - start
    stats = sort_output(args.output)
    for s in stats:
        if s["error"] is not None:
            print(f"{args.input}:{s['line']}: request failed: {s['error']}", file=sys.stderr)
    print(json.dumps(summarize(stats, elapsed, len(bad), len(todo)), indent=2))
    print(f"wrote {len(stats)} results to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
