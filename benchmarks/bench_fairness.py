"""Fairness and cache-awareness of each scheduling policy on a multi-tenant trace.

    python benchmarks/bench_fairness.py                          # tiny random Llama, ~3 minutes
    python benchmarks/bench_fairness.py --policies lpm,dlpm --duration 5
    python benchmarks/bench_fairness.py --out docs/results/bench_fairness.json --plot docs/img/bench_fairness.png

The trace (token ids, no tokenizer; fixed output lengths with ignore_eos), arrivals Poisson per
tenant:
- `hot`: every request is one long shared system prompt + a short unique tail, at a high rate;
- `cold1..N`: each request a distinct prompt (nothing to share), at a low rate each;
- `vip`: a priority class (priority 10, the others 0; --enable-priority-scheduling), distinct
  prompts at a low rate.
It is replayed open-loop (arrivals never wait for completions) into the real Scheduler in this
process (the scheduler the server runs, its model worker, radix cache and KV pool), once per
policy. The clock (--clock):
- `model` (default): a step takes a modelled time, --cost-step + --cost-prefill-token per
  computed prompt token (prefill) or + --cost-decode-req per request (decode); idle gaps jump to
  the next arrival. The scheduling decisions, the cache and the model run for real; only the
  time is modelled, so the numbers do not move with the machine's load (the defaults are this
  tiny model's costs measured on a 2-core CPU: 15k prompt tokens/s, 5 ms a decode step). It
  leaves out the scheduler's own CPU time, which the `wall s` column shows.
- `engine`: each step's measured duration (idle gaps jump), `wall`: the wall clock.

Per tenant: TTFT p50 / p99 / max, queue time (arrival to its first prefill batch) p50 / p99,
share of the tokens served while the trace arrives, and its normalised service: the tokens of
its requests started (first token) while the trace arrives over its max-min fair share of all
tokens started then (water-filling over the tenants' demands: a tenant asking less than an
equal share is owed all it asked; capped at 1). Overall: throughput (prompt + output tokens over
the makespan), cache hit rate, Jain's index over the tenants' normalised service (1: every
tenant got its fair share).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from radixengine.managers.io_struct import BatchTokenIDOut, TokenizedGenerateReqInput  # noqa: E402
from radixengine.managers.scheduler import Scheduler  # noqa: E402
from radixengine.managers.scheduler_io import InProcessIO  # noqa: E402
from radixengine.sampling.sampling_params import SamplingParams  # noqa: E402
from radixengine.server_args import ServerArgs  # noqa: E402

# name -> (schedule_policy, extra server args)
POLICIES = {
    "fcfs": ("fcfs", {}),
    "lpm": ("lpm", {}),
    "lpm-aged": ("lpm", {"lpm_aging_tokens_per_pass": 16}),
    "hrrn": ("hrrn", {}),
    "shortest-prefill-first": ("shortest-prefill-first", {}),
    "dlpm": ("dlpm", {}),
}


@dataclass
class Arrival:
    t: float
    tenant: str
    ids: list[int]
    priority: int


@dataclass
class Record:
    tenant: str
    arrival: float
    prompt_len: int
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    output_tokens: int = 0


@dataclass
class Trace:
    arrivals: list[Arrival] = field(default_factory=list)

    @staticmethod
    def build(args: argparse.Namespace, vocab: int) -> Trace:
        rng = random.Random(args.seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(3, vocab) for _ in range(n)]

        def poisson(rate: float) -> list[float]:
            out, t = [], rng.expovariate(rate)
            while t < args.duration:
                out.append(t)
                t += rng.expovariate(rate)
            return out

        system = tokens(args.hot_system_len)
        trace = Trace()
        for t in poisson(args.hot_rate):
            trace.arrivals.append(Arrival(t, "hot", system + tokens(args.hot_tail_len), 0))
        for c in range(args.cold_tenants):
            for t in poisson(args.cold_rate):
                trace.arrivals.append(Arrival(t, f"cold{c + 1}", tokens(args.cold_len), 0))
        for t in poisson(args.vip_rate):
            trace.arrivals.append(Arrival(t, "vip", tokens(args.vip_len), 10))
        trace.arrivals.sort(key=lambda a: a.t)
        return trace


class Clock:
    """See the module docstring: model, engine or wall time."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.kind = args.clock
        self.wall = self.kind == "wall"
        self.costs = (args.cost_step, args.cost_prefill_token, args.cost_decode_req)
        self.t = 0.0
        self.start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start if self.wall else self.t

    def ran(self, seconds: float, batch) -> None:
        if self.kind == "engine":
            self.t += seconds
        elif self.kind == "model" and batch is not None:
            step, per_token, per_req = self.costs
            if batch.forward_mode.is_extend():
                self.t += step + per_token * batch.extend_num_tokens
            else:
                self.t += step + per_req * batch.batch_size()

    def idle_until(self, t: float) -> None:
        if self.wall:
            time.sleep(max(0.0, t - self.now()))
        else:
            self.t = max(self.t, t)


def replay(
    sched: Scheduler, trace: Trace, max_new_tokens: int, clock: Clock
) -> tuple[dict[str, Record], float]:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    records: dict[str, Record] = {}
    pending = list(trace.arrivals)
    nxt = 0
    while nxt < len(pending) or not sched.is_idle():
        now = clock.now()
        batch_in = []
        while nxt < len(pending) and pending[nxt].t <= now:
            a = pending[nxt]
            rid = f"r{nxt}"
            req = TokenizedGenerateReqInput(
                rid, None, a.ids, params, priority=a.priority, routing_key=a.tenant
            )
            records[rid] = Record(a.tenant, a.t, len(a.ids))
            batch_in.append(req)
            nxt += 1
        if batch_in:
            sched.io.put(*batch_in)
        sched.process_input_requests(sched.recv_requests())
        if sched.is_idle():
            if nxt < len(pending):
                clock.idle_until(pending[nxt].t)
            continue
        start = clock.now()
        tic = time.perf_counter()
        batch = sched.run_step()
        clock.ran(time.perf_counter() - tic, batch)
        end = clock.now()
        if batch is not None and batch.forward_mode.is_extend():
            for r in batch.reqs:
                rec = records.get(r.rid)
                if rec is not None and rec.admitted is None:
                    rec.admitted = start
        for msg in sched.io.take_outputs():
            if not isinstance(msg, BatchTokenIDOut):
                continue
            for i, rid in enumerate(msg.rids):
                rec = records[rid]
                if msg.output_ids[i] and rec.first_token is None:
                    rec.first_token = end
                rec.output_tokens += len(msg.output_ids[i])
                if msg.finished_reasons[i] is not None:
                    rec.finished = end
    return records, clock.now()


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if xs and any(xs) else 0.0


def max_min_shares(demand: dict[str, float], capacity: float) -> dict[str, float]:
    """Water-filling: tenants asking less than an equal split of what is left get all of it."""
    share, left, todo = {}, capacity, sorted(demand, key=demand.get)
    while todo:
        equal = left / len(todo)
        t = todo.pop(0)
        share[t] = min(demand[t], equal)
        left -= share[t]
    return share


def normalised_service(records: dict[str, Record], duration: float, max_new: int) -> dict[str, float]:
    demand: dict[str, float] = {}
    served: dict[str, float] = {}
    for r in records.values():
        if r.arrival <= duration:
            demand[r.tenant] = demand.get(r.tenant, 0) + r.prompt_len + max_new
            if r.first_token <= duration:
                served[r.tenant] = served.get(r.tenant, 0) + r.prompt_len + max_new
    shares = max_min_shares(demand, sum(served.values()))
    return {t: min(1.0, served.get(t, 0) / shares[t]) if shares[t] else 1.0 for t in demand}


def summarize(
    records: dict[str, Record], makespan: float, duration: float, sched: Scheduler, max_new: int
) -> dict:
    tenants = sorted({r.tenant for r in records.values()}, key=lambda t: (t != "hot", t != "vip", t))
    served_in_window = {
        t: sum(
            r.prompt_len + r.output_tokens
            for r in records.values()
            if r.tenant == t and r.finished and r.finished <= duration
        )
        for t in tenants
    }
    window_total = sum(served_in_window.values()) or 1
    service = normalised_service(records, duration, max_new)
    per_tenant = {}
    for t in tenants:
        recs = [r for r in records.values() if r.tenant == t]
        ttft = [r.first_token - r.arrival for r in recs]
        queue = [r.admitted - r.arrival for r in recs]
        per_tenant[t] = {
            "requests": len(recs),
            "ttft_p50": pct(ttft, 0.5),
            "ttft_p99": pct(ttft, 0.99),
            "ttft_max": max(ttft),
            "queue_p50": pct(queue, 0.5),
            "queue_p99": pct(queue, 0.99),
            "token_share": served_in_window[t] / window_total,
            "normalised_service": service.get(t, 1.0),
        }
    total_tokens = sum(r.prompt_len + r.output_tokens for r in records.values())
    cold = [r.first_token - r.arrival for r in records.values() if r.tenant.startswith("cold")]
    s = sched.stats
    return {
        "makespan_s": makespan,
        "throughput_tok_s": total_tokens / makespan,
        "prefill_tokens": s.num_prefill_tokens,
        "cached_tokens": s.num_cached_tokens,
        "cache_hit_rate": s.cache_hit_rate,
        "jain": jain([v["normalised_service"] for v in per_tenant.values()]),
        "cold_ttft_p50": pct(cold, 0.5),
        "cold_ttft_p99": pct(cold, 0.99),
        "preempted": s.num_preempted_reqs,
        "retracted": s.num_retracted_reqs,
        "tenants": per_tenant,
    }


def build_tiny_model(folder: Path, vocab: int) -> str:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=4096,
    )
    config.architectures = ["LlamaForCausalLM"]
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def server_args(
    args: argparse.Namespace, model_path: str | None, policy: str = "fcfs", **extra
) -> ServerArgs:
    return ServerArgs(
        model_path=model_path,
        device="cpu",
        dtype="float32",
        attention_backend="torch_native" if args.model == "tiny" else "auto",
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        disable_overlap_schedule=True,
        num_threads=args.num_threads,
        schedule_policy=policy,
        enable_priority_scheduling=True,
        lpm_fallback_queue_len=args.lpm_fallback_queue_len,
        **extra,
    )


def run_policy(args, name: str, model_path: str | None, worker, trace: Trace) -> dict:
    base, _, value = name.partition(":")  # dlpm:128 = --dlpm-quantum-tokens 128, lpm-aged:64 likewise
    policy, extra = POLICIES[base]
    if base == "dlpm":
        extra = {"dlpm_quantum_tokens": int(value or args.dlpm_quantum)}
    if base == "lpm-aged":
        extra = {"lpm_aging_tokens_per_pass": int(value or args.aging)}
    req_pool, allocator = worker.get_memory_pool()
    req_pool.clear()
    allocator.clear()
    sched = Scheduler(server_args(args, model_path, policy, **extra), tp_worker=worker, io=InProcessIO())
    tic = time.perf_counter()
    records, makespan = replay(sched, trace, args.max_new_tokens, Clock(args))
    out = summarize(records, makespan, args.duration, sched, args.max_new_tokens)
    out["policy"] = name
    out["wall_s"] = time.perf_counter() - tic
    out["flags"] = {"schedule_policy": policy, **extra}
    return out


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'policy':<23}{'tok/s':>8}{'hit':>7}{'jain':>6}{'cold p50':>9}{'cold p99':>9}"
        f"{'hot p99':>8}{'vip p99':>8}{'makespan':>9}{'wall s':>7}"
    )
    for r in rows:
        t = r["tenants"]
        print(
            f"{r['policy']:<23}{r['throughput_tok_s']:>8.0f}{r['cache_hit_rate']:>7.3f}{r['jain']:>6.2f}"
            f"{r['cold_ttft_p50']:>9.2f}{r['cold_ttft_p99']:>9.2f}{t['hot']['ttft_p99']:>8.2f}"
            f"{t.get('vip', {}).get('ttft_p99', float('nan')):>8.2f}{r['makespan_s']:>9.1f}{r['wall_s']:>7.1f}"
        )
    print("\nper tenant: TTFT p50/p99/max, queue p50/p99 (s), token share, normalised service")
    for r in rows:
        print(f"  {r['policy']}")
        for tenant, v in r["tenants"].items():
            print(
                f"    {tenant:<7} n={v['requests']:<4} ttft {v['ttft_p50']:.2f}/{v['ttft_p99']:.2f}/{v['ttft_max']:.2f}"
                f"  queue {v['queue_p50']:.2f}/{v['queue_p99']:.2f}  share {v['token_share']:.3f}"
                f"  service {v['normalised_service']:.2f}"
            )


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tenants = list(rows[0]["tenants"])
    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, r in enumerate(rows):
        xs = [j + i * width for j in range(len(tenants))]
        ax.bar(xs, [r["tenants"][t]["ttft_p99"] for t in tenants], width, label=r["policy"])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tenants))], tenants)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT p99 (s, log)")
    ax.set_title("Per-tenant p99 TTFT by scheduling policy (bench_fairness.py)")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="'tiny' (random weights), 'default' (SmolLM2) or a path")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--duration", type=float, default=8.0, help="seconds of arrivals")
    p.add_argument("--hot-rate", type=float, default=110.0)
    p.add_argument("--hot-system-len", type=int, default=1024)
    p.add_argument("--hot-tail-len", type=int, default=32)
    p.add_argument("--cold-tenants", type=int, default=4)
    p.add_argument("--cold-rate", type=float, default=2.0, help="per cold tenant")
    p.add_argument("--cold-len", type=int, default=384)
    p.add_argument("--vip-rate", type=float, default=1.0)
    p.add_argument("--vip-len", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument(
        "--lpm-fallback-queue-len",
        type=int,
        default=512,
        help="lpm, hrrn, spf and dlpm stop matching prefixes past this queue length (engine default 128)",
    )
    p.add_argument("--aging", type=int, default=16, help="lpm-aged: --lpm-aging-tokens-per-pass")
    p.add_argument("--dlpm-quantum", type=int, default=512, help="dlpm: --dlpm-quantum-tokens")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--clock", choices=("model", "engine", "wall"), default="model")
    p.add_argument("--cost-step", type=float, default=0.004, help="model clock: seconds a step")
    p.add_argument("--cost-prefill-token", type=float, default=6.5e-5, help="model clock: a prompt token")
    p.add_argument("--cost-decode-req", type=float, default=3e-4, help="model clock: a request in decode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file for the results")
    p.add_argument("--plot", default=None, help="PNG file for the per-tenant p99 TTFT plot")
    args = p.parse_args()

    from radixengine.model_executor.tp_worker import TpModelWorker

    tmp = tempfile.TemporaryDirectory()
    vocab = 512
    model_path = None if args.model == "default" else args.model
    if args.model == "tiny":
        model_path = build_tiny_model(Path(tmp.name), vocab)
    worker = TpModelWorker(server_args(args, model_path))
    vocab = worker.get_worker_info().vocab_size
    trace = Trace.build(args, vocab)
    counts = {}
    for a in trace.arrivals:
        counts[a.tenant] = counts.get(a.tenant, 0) + 1
    load = os.getloadavg()
    print(f"model={args.model} requests={len(trace.arrivals)} {counts} load average {load[0]:.2f}")
    # Warm-up (first forwards of each shape are slower).
    warm = Trace(trace.arrivals[:20])
    run_policy(args, "fcfs", model_path, worker, warm)
    rows = []
    for name in args.policies.split(","):
        rows.append(run_policy(args, name, model_path, worker, trace))
        print(f"  {name}: {rows[-1]['wall_s']:.1f} s wall")
    print_table(rows)
    lpm = next((r for r in rows if r["policy"] == "lpm"), None)
    if lpm is not None:
        print("\nvs lpm: cache hits (cached tokens) and throughput")
        for r in rows:
            print(
                f"  {r['policy']:<23} cached {r['cached_tokens'] / max(lpm['cached_tokens'], 1):.3f}"
                f"  throughput {r['throughput_tok_s'] / lpm['throughput_tok_s']:.3f}"
                f"  cold p99/p50 {r['cold_ttft_p99'] / r['cold_ttft_p50']:.2f}"
            )
    load_after = os.getloadavg()
    if args.out:
        meta = {k: v for k, v in vars(args).items() if k not in ("out", "plot")}
        meta["load_average_before_after"] = [load[0], load_after[0]]
        Path(args.out).write_text(json.dumps({"args": meta, "counts": counts, "results": rows}, indent=2))
    if args.plot:
        plot(rows, args.plot)
    print(f"load average after: {load_after[0]:.2f}")


if __name__ == "__main__":
    main()
