"""summary.md of a `benchmarks/gpu_check.sh` run: the machine, each stage's outcome and the tables
docs/benchmarks.md takes, from the files the stages left in the results folder.

    python benchmarks/gpu_summary.py gpu_out          # writes gpu_out/summary.md
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

# tests whose outcome the summary lists one by one (substrings of the test id)
CHECKS = {
    "CUDA graph on/off greedy equality": "test_cuda_graph_on_off_equal",
    "CUDA graph replay keeps other requests' cache": "test_cuda_graph_replays",
    "triton == torch_native == transformers": "test_triton_matches_torch_native_and_transformers",
    "windowed models on triton": "test_windowed_models_triton",
    "decode kernel vs SDPA": "test_decode_attention_kernel",
    "fused RMSNorm / SiLU-and-mul": "test_fused_rms_norm_and_silu_and_mul",
    "CUDA extend + decode vs transformers": "test_cuda_extend_and_decode_match_transformers",
}


def read_stages(results: Path) -> list[dict]:
    """Each stage's latest run, in the order the stages first ran."""
    path = results / "stages.jsonl"
    if not path.exists():
        return []
    latest: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            stage = json.loads(line)
            latest[stage["stage"]] = stage
    return list(latest.values())


def junit_cases(path: Path) -> list[tuple[str, str, str]]:
    """(test id, outcome, message) per test case of a pytest junit XML file."""
    if not path.exists():
        return []
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or "").splitlines()[0][:160] if node.get("message") else ""
                break
        cases.append((test_id, outcome, message))
    return cases


def outcome_counts(cases: list[tuple[str, str, str]]) -> str:
    counts = Counter(outcome for _, outcome, _ in cases)
    return ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "error", "skipped") if counts[k])


def machine_section(results: Path) -> list[str]:
    path = results / "env.json"
    if not path.exists():
        return ["No env.json: the env stage did not run."]
    env = json.loads(path.read_text())
    return [
        f"- GPU: {env.get('gpu')} (driver {env.get('driver')}, {env.get('gpu_count')} visible)",
        f"- torch {env.get('torch')}, CUDA {env.get('cuda')}, Triton {env.get('triton')}, "
        f"transformers {env.get('transformers')}, flashinfer {env.get('flashinfer')}",
        f"- host CPU: {env.get('cpu')}, {env.get('cores')} cores; commit {env.get('commit')}; {env.get('time')}",
    ]


def stages_section(stages: list[dict], results: Path) -> list[str]:
    lines = ["| stage | exit | seconds | tests | note |", "|---|---:|---:|---|---|"]
    for s in stages:
        cases = junit_cases(results / f"{s['stage']}.xml")
        exit_code = {-1: "–", 124: "timed out", 137: "timed out"}.get(s["rc"], s["rc"])
        note = s.get("note", "")
        lines.append(
            f"| {s['stage']} | {exit_code} | {s['seconds']} | {outcome_counts(cases) or '–'} | {note} |"
        )
    return lines


def checks_section(results: Path) -> list[str]:
    cases = junit_cases(results / "backends.xml") + junit_cases(results / "suite.xml")
    if not cases:
        return ["No GPU test results."]
    lines = ["| check | outcome |", "|---|---|"]
    for label, needle in CHECKS.items():
        mine = [c for c in cases if needle in c[0]]
        lines.append(f"| {label} | {outcome_counts(mine) or 'not run'} |")
    bad = [c for c in cases if c[1] in ("failed", "error")]
    if bad:
        lines += ["", "Failed:"] + [f"- `{test_id}`: {message}" for test_id, _, message in bad[:40]]
    return lines


def decode_section(results: Path) -> list[str]:
    path = results / "decode.json"
    if not path.exists():
        return ["Not run."]
    rows = json.loads(path.read_text())["results"]
    sizes = sorted({r["batch_size"] for r in rows})
    lines = [
        "| model | variant | " + " | ".join(f"bs {b} ms" for b in sizes) + " |",
        "|---|---|" + "---:|" * len(sizes),
    ]
    for model, variant in dict.fromkeys((r["model"], r["variant"]) for r in rows):
        cells = {
            r["batch_size"]: r["step_ms"] for r in rows if (r["model"], r["variant"]) == (model, variant)
        }
        lines.append(
            f"| {model} | {variant} | "
            + " | ".join(f"{cells.get(b, float('nan')):.2f}" for b in sizes)
            + " |"
        )
    return lines


def overlap_section(results: Path) -> list[str]:
    path = results / "overlap.json"
    if not path.exists():
        return ["Not run."]
    rows = json.loads(path.read_text())["results"]
    lines = [
        "| model | bs | normal tok/s | overlap tok/s | overlap / normal | step ms n / o | sched CPU ms n / o | device idle n / o |",
        "|---|---:|---:|---:|---:|---|---|---|",
    ]
    pairs: dict[tuple[str, int], dict[str, dict]] = {}
    for r in rows:
        pairs.setdefault((r["model"], r["bs"]), {})[r["loop"]] = r
    misses = []
    for (model, bs), pair in pairs.items():
        n, o = pair["normal"], pair["overlap"]
        ratio = o["tokens_per_s"] / n["tokens_per_s"]
        lines.append(
            f"| {model} | {bs} | {n['tokens_per_s']:.0f} | {o['tokens_per_s']:.0f} | {ratio:.2f} | "
            f"{n['step_ms']:.2f} / {o['step_ms']:.2f} | {n['sched_cpu_ms']:.3f} / {o['sched_cpu_ms']:.3f} | "
            f"{n['device_idle']:.1%} / {o['device_idle']:.1%} |"
        )
        if ratio < 1.0:
            misses.append(f"overlap < normal at {model} bs {bs} ({ratio:.2f})")
        if bs >= 8 and o["device_idle"] >= 0.02:
            misses.append(f"overlap idle {o['device_idle']:.1%} at {model} bs {bs}")
    target = "met" if not misses else "not met: " + "; ".join(misses)
    return lines + ["", f"Targets (overlap idle < 2% at bs >= 8, overlap >= normal at every bs): {target}."]


def syncs_section(results: Path) -> list[str]:
    path = results / "syncs.json"
    if not path.exists():
        return ["Not run."]
    data = json.loads(path.read_text())
    lines = [
        f"{data['model']}, bs {data['bs']}: host syncs per decode step "
        "(torch.cuda.set_sync_debug_mode warnings).",
        "",
        "| loop | decode steps | syncs / step | launch side / step | top sources |",
        "|---|---:|---:|---:|---|",
    ]
    for r in data["rows"]:
        top = ", ".join(f"{where} ({n})" for where, n in list(r["sources"].items())[:4]) or "–"
        lines.append(
            f"| {r['loop']} | {r['decode_steps']} | {r['syncs_per_step']:.2f} | "
            f"{r['launch_side_syncs_per_step']:.2f} | {top} |"
        )
    overlap = next(r for r in data["rows"] if r["loop"] == "overlap")
    target = "met" if overlap["max_launch_side_syncs"] == 0 else "not met"
    return lines + ["", f"Target (no sync on the overlap loop's launch side): {target}."]


def offline_section(results: Path) -> list[str]:
    path = results / "offline.json"
    if not path.exists():
        return ["Not run."]
    data = json.loads(path.read_text())
    rows = data["rows"]
    lines = (
        ["Weights: seeded random, of the model's shape.", ""] if data["meta"].get("random_weights") else []
    )
    lines += [
        "| workload | dtype | system | output tok/s | × transformers | TTFT mean / max (s) | cache hit |",
        "|---|---|---|---:|---:|---|---:|",
    ]
    for r in rows:
        ratio = f"{r['ratio_vs_transformers']:.2f}" if r.get("ratio_vs_transformers") else "–"
        ttft = f"{r['ttft_mean_s']:.2f} / {r['ttft_max_s']:.2f}" if "ttft_max_s" in r else "–"
        hit = f"{r['cache_hit_rate']:.1%}" if "cache_hit_rate" in r else "–"
        lines.append(
            f"| {r['workload']} | {r['dtype']} | {r['system']} | {r['output_tok_s']:.1f} | {ratio} | {ttft} | {hit} |"
        )
    return lines


def summary(results: Path) -> str:
    sections = [
        ("Machine", machine_section(results)),
        ("Stages", stages_section(read_stages(results), results)),
        ("GPU checks", checks_section(results)),
        ("Decode step (bench_gpu_decode.py)", decode_section(results)),
        ("Host syncs per decode step (count_syncs.py)", syncs_section(results)),
        ("Overlap ablation (bench_overlap.py)", overlap_section(results)),
        ("Offline W1/W2 (bench_offline.py)", offline_section(results)),
    ]
    out = ["# gpu_check.sh summary", ""]
    for title, lines in sections:
        out += [f"## {title}", "", *lines, ""]
    return "\n".join(out)


def main(argv: list[str]) -> None:
    results = Path(argv[1] if len(argv) > 1 else "gpu_out")
    (results / "summary.md").write_text(summary(results))
    print(f"wrote {results / 'summary.md'}")


if __name__ == "__main__":
    main(sys.argv)
