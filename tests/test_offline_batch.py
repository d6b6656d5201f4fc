"""examples/offline_batch.py on a small JSONL with one malformed line: the results come back in
input order, the bad line is reported with its number and skipped, the summary is printed; bad
arguments are usage errors before the model loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
