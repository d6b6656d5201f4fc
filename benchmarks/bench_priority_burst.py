"""Hard versus soft priority preemption on a burst of high-priority arrivals into a tight KV pool.

    python benchmarks/bench_priority_burst.py
    python benchmarks/bench_priority_burst.py --chunked-prefill-size 512   # the victims' prompts chunked

`--low` low-priority requests (priority 0) with long distinct prompts arrive at t=0 and decode
long outputs; at `--burst-at` seconds, while they decode, `--burst` high-priority requests
(priority 100, past the preemption threshold) arrive at once. The pool is sized so the burst
does not fit beside them: admission preempts running low-priority requests. Each mode replays
the same trace into the real Scheduler (bench_fairness.py's replay, model clock):
- `hard`: the victims' KV is freed; they recompute their prompt and output when readmitted;
- `soft` (`--soft-priority-preemption`): the victims' KV goes to the radix cache, evictable,
  and evictions take only the pages they need from a leaf's end (`evict_leaf_tails`), so what
  the burst does not take is reused when they come back.
Reported: tokens recomputed (prefill tokens computed less the trace's prompt tokens: the prompts
share nothing, so every token computed twice counts, a victim's output included), the tokens a
readmitted victim found cached, preemptions, the burst's TTFT and the low-priority requests' completion.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_fairness import Arrival, Clock, Trace, build_tiny_model, pct, replay  # noqa: E402

from radixengine.managers.scheduler import Scheduler  # noqa: E402
from radixengine.managers.scheduler_io import InProcessIO  # noqa: E402
from radixengine.server_args import ServerArgs  # noqa: E402

MODES = {"hard": {}, "soft": {"soft_priority_preemption": True}}


def build_trace(args: argparse.Namespace, vocab: int) -> Trace:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    low = [Arrival(0.0, "low", tokens(args.low_len), 0) for _ in range(args.low)]
    burst = [Arrival(args.burst_at, "burst", tokens(args.burst_len), 100) for _ in range(args.burst)]
    return Trace(low + burst)


def server_args(args: argparse.Namespace, model_path: str, **extra) -> ServerArgs:
    return ServerArgs(
        model_path=model_path,
        device="cpu",
        dtype="float32",
        attention_backend="torch_native",
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        disable_overlap_schedule=True,
        enable_priority_scheduling=True,
        radix_eviction_policy=args.eviction,
        **extra,
    )


def run_mode(args, mode: str, model_path: str, worker, trace: Trace) -> dict:
    req_pool, allocator = worker.get_memory_pool()
    req_pool.clear()
    allocator.clear()
    sched = Scheduler(server_args(args, model_path, **MODES[mode]), tp_worker=worker, io=InProcessIO())
    tic = time.perf_counter()
    records, makespan = replay(sched, trace, args.max_new_tokens, Clock(args))
    distinct = sum(len(a.ids) for a in trace.arrivals)
    burst = [r.first_token - r.arrival for r in records.values() if r.tenant == "burst"]
    low_done = [r.finished for r in records.values() if r.tenant == "low"]
    s = sched.stats
    return {
        "mode": mode,
        "recomputed_tokens": s.num_prefill_tokens - distinct,
        "computed_prefill_tokens": s.num_prefill_tokens,
        "cached_tokens": s.num_cached_tokens,
        "preempted": s.num_preempted_reqs,
        "burst_ttft_p50": pct(burst, 0.5),
        "burst_ttft_max": max(burst),
        "low_finish_max": max(low_done),
        "makespan_s": makespan,
        "wall_s": time.perf_counter() - tic,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--low", type=int, default=4, help="low-priority requests, running when the burst comes")
    p.add_argument("--low-len", type=int, default=3072)
    p.add_argument("--burst", type=int, default=4)
    p.add_argument("--burst-len", type=int, default=256)
    p.add_argument("--burst-at", type=float, default=1.2, help="seconds (model clock)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-total-tokens", type=int, default=13312)
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=4096,
        help="a prompt longer than this is inserted into the cache chunk by chunk: hard preemption keeps those chunks too",
    )
    p.add_argument("--eviction", default="lru", help="--radix-eviction-policy")
    p.add_argument("--clock", choices=("model", "engine", "wall"), default="model")
    p.add_argument("--cost-step", type=float, default=0.004)
    p.add_argument("--cost-prefill-token", type=float, default=6.5e-5)
    p.add_argument("--cost-decode-req", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file for the results")
    args = p.parse_args()

    from radixengine.model_executor.tp_worker import TpModelWorker

    tmp = tempfile.TemporaryDirectory()
    model_path = build_tiny_model(Path(tmp.name), 512)
    worker = TpModelWorker(server_args(args, model_path))
    trace = build_trace(args, worker.get_worker_info().vocab_size)
    rows = [run_mode(args, mode, model_path, worker, trace) for mode in MODES]
    print(f"{'mode':<6}{'recomputed':>11}{'preempted':>10}{'burst TTFT p50/max':>20}{'low done':>9}")
    for r in rows:
        print(
            f"{r['mode']:<6}{r['recomputed_tokens']:>11}{r['preempted']:>10}"
            f"{r['burst_ttft_p50']:>11.3f} / {r['burst_ttft_max']:.3f}{r['low_finish_max']:>9.2f}"
        )
    hard, soft = rows
    ratio = soft["recomputed_tokens"] / max(hard["recomputed_tokens"], 1)
    print(f"soft / hard recomputed tokens: {ratio:.3f}")
    if args.out:
        meta = {k: v for k, v in vars(args).items() if k != "out"}
        meta["load_average"] = os.getloadavg()[0]
        Path(args.out).write_text(
            json.dumps({"args": meta, "results": rows, "soft_over_hard": ratio}, indent=2)
        )


if __name__ == "__main__":
    main()
