"""benchmarks/bench_speculative.py runs end to end on a tiny random model (the copy-heavy workload
W4, batch 1 and 2, a few tokens): the JSON, the table and the plot come out, speculation on and
off give the same greedy tokens, the NGRAM engine really verified drafts, and STANDALONE ran with
the random draft the benchmark made from the target's config."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from test_engine_utils import build_tiny_model

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_speculative  # noqa: E402


def test_bench_speculative_runs_on_a_tiny_model(tmp_path, capsys):
    model = build_tiny_model(str(tmp_path / "model"))
    out, png = tmp_path / "spec.json", tmp_path / "spec.png"
    bench_speculative.main(
        [
            "--model-path", model, "--workloads", "W4", "--batch-sizes", "1,2", "--batch1-requests", "2",
            "--max-new-tokens", "12", "--repeats", "2", "--max-total-tokens", "16384", "--random-draft-layers", "1",
            "--output", str(out), "--plot", str(png),
        ]
    )  # fmt: skip
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["batch_size"], r["speculative_algorithm"]) for r in rows] == [
        (1, None), (1, "NGRAM"), (1, "STANDALONE"), (2, None), (2, "NGRAM"), (2, "STANDALONE")
    ]  # fmt: skip
    for r in rows:
        assert r["output_tokens"] == 2 * 12 and r["output_tok_s"] > 0
        assert len(r["output_tok_s_all_repeats"]) == 2
        assert 0 < r["finish_first_s"] <= r["finish_last_s"] and r["ttft_mean_s"] > 0
    for r in rows:
        if r["speculative_algorithm"]:
            assert r["same_tokens_as_off"] == r["requests"] == 2
    for r in rows[1::3]:
        assert r["spec_verify_reqs"] > 0 and r["avg_spec_accept_length"] >= 1.0
    assert all(r["spec_verify_reqs"] == 0 for r in rows[::3])
    draft = Path(result["meta"]["draft_model_path"])
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 1
    assert png.stat().st_size > 0
    table = capsys.readouterr().out
    assert "| W4 | 1 (×2 in turn) | NGRAM |" in table and "| W4 | 2 | STANDALONE |" in table
