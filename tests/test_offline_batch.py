"""examples/offline_batch.py on a small JSONL with one malformed line: the results come back in
input order, the bad line is reported with its number and skipped, the summary is printed; bad
arguments are usage errors before the model loads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_engine_utils import REPO_ROOT, build_tiny_model, subprocess_env

LINES = [
    {
        "id": "a",
        "text": "hello world",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
    },
    {
        "id": "b",
        "messages": [{"role": "user", "content": "hi there"}],
        "sampling_params": {"max_new_tokens": 3},
    },
    "{this is not json",
    {"id": "c", "input_ids": [5, 6, 7]},
    {"id": "d", "text": "x", "sampling_params": {"temperature": -1}},
    {"id": "e", "text": "z", "sampling_params": None},  # null: the defaults
]
SCRIPT = os.path.join(REPO_ROOT, "examples", "offline_batch.py")


def test_offline_batch_script(tmp_path):
    model = build_tiny_model(str(tmp_path / "model"))
    src, dst = tmp_path / "in.jsonl", tmp_path / "new" / "sub" / "out.jsonl"  # its directory is created
    src.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in LINES) + "\n")
    cmd = [
        sys.executable, SCRIPT, "--input", str(src),
        "--output", str(dst), "--model-path", model, "--dtype", "float32", "--max-total-tokens", "4096",
        "--num-threads", "1", "--max-new-tokens", "5", "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    assert f"{src}:3: skipped malformed line" in proc.stderr
    assert f"{src}:5: request failed" in proc.stderr and "temperature" in proc.stderr
    results = [json.loads(line) for line in dst.read_text().splitlines()]
    assert "malformed" not in proc.stderr.replace(f"{src}:3: skipped malformed line", "")
    assert [r["line"] for r in results] == [1, 2, 4, 5, 6]
    assert [r["id"] for r in results] == ["a", "b", "c", "d", "e"]
    assert [r["meta_info"]["completion_tokens"] for r in results[:1]] == [4]
    assert results[1]["meta_info"]["completion_tokens"] <= 3
    assert results[2]["meta_info"]["completion_tokens"] <= 5  # the --max-new-tokens default
    assert "error" in results[3] and "text" not in results[3]
    assert "error" not in results[4] and 1 <= results[4]["meta_info"]["completion_tokens"] <= 5
    summary = json.loads(proc.stdout)
    assert summary["requests"] == 5 and summary["failed"] == 1 and summary["malformed_lines"] == 1
    ok = results[:3] + results[4:]
    assert summary["completion_tokens"] == sum(r["meta_info"]["completion_tokens"] for r in ok)
    assert "tok/s" in proc.stderr  # the progress bar


@pytest.mark.parametrize(
    "args,message",
    [
        (["--input", "{missing}"], "--input {missing}: no such file"),
        (["--input", "{tmp}"], "--input {tmp}: not a file"),
        (["--output", "{tmp}"], "--output {tmp}: is a directory"),
        (["--output", "{file}/sub/out.jsonl"], "--output {file}/sub/out.jsonl: cannot create its directory"),
        (["--max-new-tokens", "-5"], "--max-new-tokens: must be a positive integer, got '-5'"),
        (["--max-new-tokens", "0"], "--max-new-tokens: must be a positive integer, got '0'"),
    ],
)
def test_bad_arguments_are_usage_errors_before_the_model_loads(tmp_path, args, message):
    """A one-line usage error (exit code 2), not a traceback, and before the model loads (the model
    path does not exist, so a load would fail otherwise)."""
    names = {"missing": tmp_path / "missing.jsonl", "tmp": tmp_path, "file": tmp_path / "in.jsonl"}
    names["file"].write_text(json.dumps({"text": "hi"}) + "\n")
    args = [a.format(**names) for a in args]
    args = args if "--input" in args else ["--input", str(names["file"]), *args]
    model = str(tmp_path / "no-model")
    cmd = [sys.executable, SCRIPT, "--model-path", model, "--output", str(tmp_path / "out.jsonl"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("offline_batch.py: error: ") and message.format(**names) in last


def test_help_says_what_max_new_tokens_is(tmp_path):
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=120, env=subprocess_env()
    )
    assert proc.returncode == 0
    assert "lines whose sampling_params do not give their own" in " ".join(proc.stdout.split())


# OpenAI's batch format, results written as they finish, --resume ---------------------------------

CHAT = {"messages": [{"role": "user", "content": "hello world"}], "temperature": 0, "ignore_eos": True}
# Short lines of both formats and one long line: a run killed once the short ones are written
# has the long one still in flight.
MIXED = [
    {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions", "body": {**CHAT, "max_tokens": 3}},
    {"id": "own-1", "text": "hello world", "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                "ignore_eos": True}},
    {"custom_id": "long", "url": "/v1/chat/completions", "body": {**CHAT, "max_tokens": 2500}},
    {"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "hello", "max_tokens": 2, "temperature": 0}},
    {"custom_id": "bad-url", "url": "/v1/embeddings", "body": {}},
    {"text": "no id here", "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}},
    {"custom_id": "refused", "url": "/v1/chat/completions", "body": {**CHAT, "temperature": -1}},
]  # fmt: skip
VOLATILE = {"id", "request_id", "created", "e2e_latency", "cached_tokens", "prompt_tokens_details"}


def stable(record: dict) -> dict:
    """A result without what differs between any two runs (a line's own `id` is kept)."""
    cleaned = _drop_volatile(record)
    if "custom_id" not in record and "id" in record:
        cleaned["id"] = record["id"]
    return cleaned


def _drop_volatile(value):
    if isinstance(value, dict):
        return {k: _drop_volatile(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_drop_volatile(v) for v in value]
    return value


def batch_cmd(model: str, src, dst, *extra: str) -> list[str]:
    return [sys.executable, SCRIPT, "--input", str(src), "--output", str(dst), "--model-path", model,
            "--dtype", "float32", "--max-total-tokens", "8192", "--num-threads", "1", "--log-level", "warning",
            *extra]  # fmt: skip


def test_openai_format_and_resume_after_a_kill(tmp_path):
    model = build_tiny_model(str(tmp_path / "model"), max_position_embeddings=4096)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in MIXED))
    whole = tmp_path / "whole.jsonl"
    proc = subprocess.run(batch_cmd(model, src, whole), capture_output=True, text=True, timeout=600,
                          env=subprocess_env())  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in whole.read_text().splitlines()]
    assert [r["line"] for r in results] == [1, 2, 3, 4, 6, 7]  # input order; line 5 is malformed
    assert f"{src}:5: skipped malformed line: url must be one of" in proc.stderr
    chat = results[0]
    assert chat["custom_id"] == "chat-1" and chat["id"].startswith("batch_req_") and chat["error"] is None
    body = chat["response"]["body"]
    assert chat["response"]["status_code"] == 200 and body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] == 3
    assert results[1]["id"] == "own-1" and results[1]["meta_info"]["completion_tokens"] == 4
    assert results[3]["response"]["body"]["object"] == "text_completion"
    assert "id" not in results[4] and results[4]["meta_info"]["completion_tokens"] == 3
    refused = results[5]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "temperature"

    # Killed (the whole process group) once every short line is written: the long one is lost.
    out = tmp_path / "resumed.jsonl"
    run = subprocess.Popen(batch_cmd(model, src, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env=subprocess_env(), start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not out.exists() or len(out.read_text().splitlines()) < 5:
            assert run.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.communicate()
    partial = out.read_text().splitlines()
    assert len(partial) == 5 and "long" not in [json.loads(line).get("custom_id") for line in partial]
    with open(out, "a") as f:
        f.write('{"line": 3, "custom_id": "long", "respo')  # a write the kill cut short
    proc = subprocess.run(batch_cmd(model, src, out, "--resume"), capture_output=True, text=True, timeout=600,
                          env=subprocess_env())  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "--resume: 5 results already in" in proc.stderr
    assert json.loads(proc.stdout)["run_now"] == 1 and json.loads(proc.stdout)["requests"] == 6
    resumed = [json.loads(line) for line in out.read_text().splitlines()]
    # The long line's 2,500 greedy tokens are compared by count only: it was prefilled beside other
    # prompts in one run and alone in the other, and CPU kernels round differently by batch shape,
    # which over thousands of steps can turn a near-tie the other way.
    long_usage = [r["response"]["body"]["usage"]["completion_tokens"] for r in (resumed[2], results[2])]
    assert long_usage == [2500, 2500] and resumed[2]["custom_id"] == results[2]["custom_id"] == "long"
    assert [stable(r) for i, r in enumerate(resumed) if i != 2] == [
        stable(r) for i, r in enumerate(results) if i != 2
    ]
    kept = {json.loads(line)["line"]: line for line in partial}
    assert all(line in out.read_text().splitlines() for line in kept.values())  # not run again


def test_jsonl_lines_duplicates_and_bytes_that_are_not_utf8(tmp_path):
    """Lines end at \\n only: a line holding U+2028 / U+2029 / U+0085 raw is one line, and its
    result (which holds them raw too) is read back by --resume. A custom_id or id an earlier line
    has, and a line that is not UTF-8, are malformed lines named by number, not run."""
    model = build_tiny_model(str(tmp_path / "model"))
    breaks = "\u2028\u2029\u0085"
    lines = [
        {"custom_id": f"c{breaks}", "url": "/v1/completions", "body": {"prompt": f"a{breaks}b", "max_tokens": 2}},
        {"id": f"own{breaks}", "text": f"x{breaks}y", "sampling_params": {"max_new_tokens": 2}},
        {"custom_id": f"c{breaks}", "url": "/v1/completions", "body": {"prompt": "again", "max_tokens": 2}},
        {"id": f"own{breaks}", "text": "again", "sampling_params": {"max_new_tokens": 2}},
    ]  # fmt: skip
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    data = b"".join(json.dumps(x, ensure_ascii=False).encode() + b"\r\n" for x in lines)
    src.write_bytes(data + b'{"text": "caf\xe9"}\n')  # Latin-1, not UTF-8
    proc = subprocess.run(batch_cmd(model, src, dst), capture_output=True, text=True, timeout=300,
                          env=subprocess_env())  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (
        f"{src}:3: skipped malformed line: custom_id {'c' + breaks!r} is not unique in the file"
        in proc.stderr
    )
    assert f'{src}:4: skipped malformed line: id "own' in proc.stderr
    assert f"{src}:5: skipped malformed line: not valid UTF-8 (byte 14: b'\\xe9')" in proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["requests"] == 2 and summary["failed"] == 0 and summary["malformed_lines"] == 3
    results = [json.loads(line) for line in dst.read_bytes().split(b"\n") if line]
    assert [(r["line"], r.get("custom_id", r.get("id"))) for r in results] == [
        (1, f"c{breaks}"),
        (2, f"own{breaks}"),
    ]
    assert breaks.encode() in dst.read_bytes()  # written raw (ensure_ascii=False)
    again = subprocess.run(batch_cmd(model, src, dst, "--resume"), capture_output=True, text=True, timeout=300,
                           env=subprocess_env())  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "--resume: 2 results already in" in again.stderr and json.loads(again.stdout)["run_now"] == 0
    assert "token accounting broken" not in proc.stderr  # the engine's idle self-check
