"""examples/offline_batch.py on a small JSONL with one malformed line: the results come back in
input order, the bad line is reported with its number and skipped, the summary is printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
]


def test_offline_batch_script(tmp_path):
    model = build_tiny_model(str(tmp_path / "model"))
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in LINES) + "\n")
    cmd = [
        sys.executable, os.path.join(REPO_ROOT, "examples", "offline_batch.py"), "--input", str(src),
        "--output", str(dst), "--model-path", model, "--dtype", "float32", "--max-total-tokens", "4096",
        "--num-threads", "1", "--max-new-tokens", "5", "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    assert f"{src}:3: skipped malformed line" in proc.stderr
    assert f"{src}:5: request failed" in proc.stderr and "temperature" in proc.stderr
    results = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["line"] for r in results] == [1, 2, 4, 5]
    assert [r["id"] for r in results] == ["a", "b", "c", "d"]
    assert [r["meta_info"]["completion_tokens"] for r in results[:1]] == [4]
    assert results[1]["meta_info"]["completion_tokens"] <= 3
    assert results[2]["meta_info"]["completion_tokens"] <= 5  # the --max-new-tokens default
    assert "error" in results[3] and "text" not in results[3]
    summary = json.loads(proc.stdout)
    assert summary["requests"] == 4 and summary["failed"] == 1 and summary["malformed_lines"] == 1
    assert summary["completion_tokens"] == sum(r["meta_info"]["completion_tokens"] for r in results[:3])
    assert "tok/s" in proc.stderr  # the progress bar
