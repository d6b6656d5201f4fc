"""Where a speculative (NGRAM) step goes against a plain decode step, at batch 1 (or
--batch-size requests submitted together) on the default model: the scheduler runs in this process, each forward is timed by its kind (decode or verify),
and so are the drafting and the scheduler's own phases.

    python benchmarks/profile_spec_step.py                       # W4's first 3 requests, one at a time
    python benchmarks/profile_spec_step.py --requests 1 --max-new-tokens 64
    python benchmarks/profile_spec_step.py --requests 8 --batch-size 8      # W4's batch-8 point

Per run (speculation off, then NGRAM): wall time, output tok/s, steps, and per step the mean
milliseconds of the forward (decode steps and verify steps apart, with the tokens a verify step
holds, and of the verification inside it: acceptance from the logits), of drafting, and of the
scheduler's own work (recv, schedule, launch, process; the
forward and drafting excluded).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_offline import WORKLOADS_DIR, load_workload, prompt_ids, workload_path  # noqa: E402

from radixengine.managers.io_struct import TokenizedGenerateReqInput  # noqa: E402
from radixengine.managers.scheduler import Scheduler  # noqa: E402
from radixengine.managers.scheduler_io import InProcessIO  # noqa: E402
from radixengine.model_executor.tp_worker import TpModelWorker  # noqa: E402
from radixengine.sampling.sampling_params import SamplingParams  # noqa: E402
from radixengine.server_args import ServerArgs  # noqa: E402


class KindTimedWorker:
    """The worker with each forward's wall time recorded under its forward mode."""

    def __init__(self, worker: TpModelWorker) -> None:
        self.worker = worker
        self.seconds: dict[str, list[float]] = defaultdict(list)
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.verification_s: list[float] = []  # the verification inside each verify step
        verify = worker._verify

        def timed_verify(*args):
            start = time.perf_counter()
            out = verify(*args)
            self.verification_s.append(time.perf_counter() - start)
            return out

        worker._verify = timed_verify

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def forward_batch_generation(self, mwb):
        start = time.perf_counter()
        out = self.worker.forward_batch_generation(mwb)
        kind = mwb.forward_mode.name.lower()
        self.seconds[kind].append(time.perf_counter() - start)
        self.tokens[kind].append(int(mwb.input_ids.numel()))
        return out


def run(
    worker: KindTimedWorker,
    model_args: dict,
    prompts: list[list[int]],
    max_new: int,
    spec: bool,
    batch_size: int = 1,
    logprobs: bool = True,
) -> dict:
    extra = dict(speculative_algorithm="NGRAM") if spec else {}
    req_pool, allocator = worker.get_memory_pool()
    req_pool.clear()
    allocator.clear()
    sched = Scheduler(ServerArgs(**model_args, **extra), tp_worker=worker, io=InProcessIO())
    draft_s: list[float] = []
    if sched.drafter is not None:
        draft = sched.drafter.draft

        def timed_draft(batch):
            start = time.perf_counter()
            out = draft(batch)
            draft_s.append(time.perf_counter() - start)
            return out

        sched.drafter.draft = timed_draft
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    ids_out: dict[str, list[int]] = defaultdict(list)
    top2: dict[str, list] = defaultdict(list)
    worker.seconds.clear()
    worker.tokens.clear()
    worker.verification_s.clear()
    sched.timer.reset()
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        for i in range(first, min(first + batch_size, len(prompts))):
            sched.io.put(
                TokenizedGenerateReqInput(
                    f"r{i}",
                    None,
                    prompts[i],
                    params,
                    return_logprob=logprobs,
                    top_logprobs_num=2 if logprobs else 0,
                )
            )
        sched.run_until_idle()
        for msg in sched.io.take_outputs():
            for j, rid in enumerate(getattr(msg, "rids", [])):
                ids_out[rid] += msg.output_ids[j]
                if logprobs:
                    top2[rid] += msg.output_top_logprobs_val[j] or []
    wall = time.perf_counter() - start
    summary = sched.timer.summary()
    stats = sched.stats
    sched.close()
    forward_total = sum(sum(v) for v in worker.seconds.values())
    steps = summary["steps"]
    row = {
        "speculation": "NGRAM" if spec else "off",
        "wall_s": wall,
        "output_tok_s": len(prompts) * max_new / wall,
        "steps": steps,
        "forward_ms_per_step": 1e3 * forward_total / steps,
        "draft_ms_per_step": 1e3 * sum(draft_s) / steps,
        # the scheduler thread's own work (the forward is a phase of its own), drafting excluded
        "scheduler_ms_per_step": summary["cpu_ms"] - 1e3 * sum(draft_s) / steps,
        "avg_spec_accept_length": stats.avg_spec_accept_length,
        "output_ids": [ids_out[f"r{i}"] for i in range(len(prompts))],
        "top2_logprobs": [top2[f"r{i}"] for i in range(len(prompts))],
    }
    for kind, secs in worker.seconds.items():
        row[f"{kind}_steps"] = len(secs)
        row[f"{kind}_forward_ms_mean"] = 1e3 * statistics.mean(secs)
        row[f"{kind}_forward_ms_median"] = 1e3 * statistics.median(secs)
        row[f"{kind}_tokens_mean"] = statistics.mean(worker.tokens[kind])
    if worker.verification_s:
        row["verification_ms_mean"] = 1e3 * statistics.mean(worker.verification_s)
    return row


def _top2_gap(tops: list, k: int) -> float | None:
    return tops[k][0] - tops[k][1] if k < len(tops) and len(tops[k]) > 1 else None


def differences(off: dict, on: dict) -> list[dict | None]:
    """Per request: None when both runs gave the same tokens; else the first position that
    differs, the two tokens and the top-2 logprob gap of each run there (a near tie when small)."""
    out = []
    for i, (a, b) in enumerate(zip(off["output_ids"], on["output_ids"])):
        if a == b:
            out.append(None)
            continue
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        gaps = {name: _top2_gap(row["top2_logprobs"][i], k) for name, row in (("off", off), ("NGRAM", on))}
        out.append({"position": k, "off": a[k : k + 1], "NGRAM": b[k : k + 1], "top2_gap": gaps})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the bundled SmolLM2 GGUF")
    p.add_argument("--workload", default="W4")
    p.add_argument("--workloads-dir", default=str(WORKLOADS_DIR))
    p.add_argument("--requests", type=int, default=3, help="the workload's first N requests")
    p.add_argument("--batch-size", type=int, default=1, help="requests submitted together (1: one at a time)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--no-logprobs",
        action="store_true",
        help="requests without logprobs (as the benchmarks send; the differences then carry no top-2 gaps)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from radixengine.model_loader import get_tokenizer

    items = load_workload(workload_path(args.workload, args.workloads_dir))[: args.requests]
    prompts = prompt_ids(get_tokenizer(args.model_path), items)
    model_args = dict(model_path=args.model_path, max_total_tokens=16384, log_level="warning")
    worker = KindTimedWorker(TpModelWorker(ServerArgs(**model_args)))
    run(worker, model_args, prompts[:1], 8, spec=False)  # warm-up
    rows = [
        run(worker, model_args, prompts, args.max_new_tokens, spec, args.batch_size, not args.no_logprobs)
        for spec in (False, True)
    ]
    rows[1]["differences"] = differences(rows[0], rows[1])
    for row in rows:
        del row["top2_logprobs"]
    print(json.dumps([{k: v for k, v in r.items() if k != "output_ids"} for r in rows], indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
