"""Ablation of the overlap loop: the same decode workload with the normal and the overlap event
loop, in one run, for several decode batch sizes.

    python benchmarks/bench_overlap.py                                 # CPU, both model shapes
    python benchmarks/bench_overlap.py --device cuda --models smollm2,llama-1b --batch-sizes 1,8,32,64,128,256 \
        --out overlap.json --plot overlap.png --trace-dir traces

Models are random weights (`--load-format dummy`) of a shape from benchmarks/model_shapes.py:
`tiny` (hidden 64, 2 layers: the forward is short, so the scheduler's cost shows), `smollm2`
(SmolLM2-135M's shape), `llama-1b`, `llama-8b`; or any HF folder. Per batch size: `bs` requests
of `--prompt-len` tokens, `--new-tokens` each (ignore_eos), all submitted at once. Reported per loop (the fastest of `--repeats` alternating runs): decode
throughput (output tokens/s over the whole run), mean step time, the scheduler thread's CPU time
per step (recv + schedule + launch + process, not the wait for the device nor an inline forward),
and the device idle fraction: the share of wall time with no forward running (forward intervals
timed with CUDA events on a GPU, with perf_counter on the CPU).

On a CPU `--cpu-layout` is the engine's `--cpu-forward-stream`: with "auto" and intra-op threads
on every core the overlap loop runs the normal step order (the JSON's `overlap_step_order` says
which order ran). For one batch size per model (`--timeline-bs`) both runs record a trace (as
`--trace-file` does); `--trace-dir` keeps those Chrome traces (open them in Perfetto or
chrome://tracing), `--plot` draws the throughput ratio, the idle fractions and, per model, a few
decode steps of both loops: the scheduler thread's phases above the forward's busy intervals.
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

import torch  # noqa: E402
from model_shapes import MODEL_SHAPES, write_shape_folder  # noqa: E402

from radixengine.managers.io_struct import TokenizedGenerateReqInput  # noqa: E402
from radixengine.managers.scheduler import Scheduler  # noqa: E402
from radixengine.managers.scheduler_io import InProcessIO  # noqa: E402
from radixengine.model_executor.tp_worker import TpModelWorker  # noqa: E402
from radixengine.sampling.sampling_params import SamplingParams  # noqa: E402
from radixengine.server_args import CPU_FORWARD_STREAMS, ServerArgs  # noqa: E402


def model_folder(name: str, root: Path) -> tuple[str, str]:
    """(path, load format): a config-only folder for a named shape, else the path itself."""
    if name not in MODEL_SHAPES:
        return name, "auto"
    return write_shape_folder(name, root, max_position_embeddings=2048), "dummy"


class TimedWorker:
    """The worker with each forward's busy interval recorded (CUDA events on a GPU)."""

    def __init__(self, worker: TpModelWorker) -> None:
        self.worker = worker
        self.cuda = str(worker.device).startswith("cuda")
        self.intervals: list = []

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def forward_batch_generation(self, mwb):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self.worker.forward_batch_generation(mwb)
            end.record()
            self.intervals.append((start, end))
        else:
            t0 = time.perf_counter()
            out = self.worker.forward_batch_generation(mwb)
            self.intervals.append((t0, time.perf_counter()))
        return out

    def busy_seconds(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return sum(s.elapsed_time(e) for s, e in self.intervals) / 1e3
        return sum(e - s for s, e in self.intervals)


def run_once(
    args,
    worker: TimedWorker,
    model_args: dict,
    bs: int,
    overlap: bool,
    vocab: int,
    trace_file: str | None = None,
) -> dict:
    server_args = ServerArgs(
        **model_args, disable_overlap_schedule=not overlap, chunked_prefill_size=-1, trace_file=trace_file
    )
    req_pool, allocator = worker.get_memory_pool()
    req_pool.clear()
    allocator.clear()
    sched = Scheduler(server_args, tp_worker=worker, io=InProcessIO())
    rng = random.Random(bs)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)

    def reqs(tag: str, n: int):
        return [
            TokenizedGenerateReqInput(
                f"{tag}{i}", None, [rng.randrange(3, vocab) for _ in range(args.prompt_len)], params
            )
            for i in range(n)
        ]

    sched.io.put(*reqs("warm", bs))
    sched.run_until_idle()
    sched.io.take_outputs()
    sched.flush_cache()
    sched.timer.reset()
    worker.intervals.clear()
    batch = reqs("r", bs)
    if worker.cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    sched.io.put(*batch)
    sched.run_until_idle()
    wall = time.perf_counter() - start
    summary = sched.timer.summary()
    busy = worker.busy_seconds()
    if trace_file:
        sched.write_trace()
    sched.close()
    row = {
        "bs": bs,
        "loop": "overlap" if overlap else "normal",
        "overlap_step_order": sched.enable_overlap,
        "tokens_per_s": bs * args.new_tokens / wall,
        "step_ms": 1e3 * wall / max(summary["steps"], 1),
        "sched_cpu_ms": summary["cpu_ms"],
        "device_idle": max(0.0, 1.0 - busy / wall),
        "wall_s": wall,
    }
    if trace_file:
        row["trace"] = read_trace(trace_file)
    return row


def read_trace(path: str) -> list[list]:
    """[lane, name, start ms, duration ms] per event of a `--trace-file` Chrome trace; lane 1 is
    the scheduler thread, lane 2 the forward."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    return [[e["tid"], e["name"], e["ts"] / 1e3, e["dur"] / 1e3] for e in events if e["ph"] == "X"]


def best_of(repeats: int, run) -> dict[str, dict]:
    """Per loop, the fastest of `repeats` runs (the loops alternate, and which goes first too, so
    that a load spike from other jobs hits both alike); every run's wall time in `walls_s`."""
    runs: dict[str, list[dict]] = {"normal": [], "overlap": []}
    for i in range(repeats):
        for loop in ("normal", "overlap") if i % 2 == 0 else ("overlap", "normal"):
            runs[loop].append(run(loop))
    best = {loop: min(rows, key=lambda r: r["wall_s"]) for loop, rows in runs.items()}
    for loop, row in best.items():
        row["walls_s"] = [r["wall_s"] for r in runs[loop]]
    return best


PHASE_COLORS = {
    "recv": "tab:gray",
    "schedule": "tab:blue",
    "launch": "tab:purple",
    "process": "tab:green",
    "wait": "lightgray",
    "forward": "tab:orange",
}


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traced = [r for r in results if "trace" in r]
    fig = plt.figure(figsize=(10, 4 + 0.9 * len(traced)))
    grid = fig.add_gridspec(1 + len(traced), 2, height_ratios=[4] + [0.9] * len(traced))
    plot_ratios(results, fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]))
    for i, r in enumerate(traced):
        plot_timeline(r, fig.add_subplot(grid[1 + i, :]), legend=i == 0)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def plot_ratios(results: list[dict], ratio_ax, idle_ax) -> None:
    from matplotlib.ticker import PercentFormatter

    for i, model in enumerate(sorted({r["model"] for r in results})):
        rows = [r for r in results if r["model"] == model]
        sizes = sorted({r["bs"] for r in rows})
        get = {(r["bs"], r["loop"]): r for r in rows}
        ratio_ax.plot(
            sizes,
            [get[b, "overlap"]["tokens_per_s"] / get[b, "normal"]["tokens_per_s"] for b in sizes],
            marker="o",
            color=f"C{i}",
            label=model,
        )
        for loop, style in (("normal", "--"), ("overlap", "-")):
            idle_ax.plot(
                sizes,
                [get[b, loop]["device_idle"] for b in sizes],
                style,
                marker="o",
                color=f"C{i}",
                label=f"{model} {loop}",
            )
    ratio_ax.axhline(1.0, color="gray", lw=0.8)
    ratio_ax.set(ylabel="throughput overlap / normal")
    idles = [r["device_idle"] for r in results if r["device_idle"] > 0]
    idle_ax.set(
        yscale="log" if idles and max(idles) > 10 * min(idles) else "linear", ylabel="device idle fraction"
    )
    idle_ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    sizes = sorted({r["bs"] for r in results})
    for a in (ratio_ax, idle_ax):
        a.set(xscale="log", xlabel="decode batch size")
        a.set_xticks(sizes, [str(b) for b in sizes])
        a.minorticks_off()
        a.legend(fontsize=8)


def plot_timeline(row: dict, ax, legend: bool, steps: int = 3) -> None:
    """`steps` decode steps from the middle of a traced run: the scheduler thread's phases (top
    lane) above the forward's busy intervals (bottom lane), in ms."""
    from matplotlib.patches import Patch

    forwards = sorted((e for e in row["trace"] if e[0] == 2 and e[1] != "wait"), key=lambda e: e[2])
    shown = forwards[len(forwards) // 2 :][:steps]
    margin = 0.15 * shown[0][3]
    t0, t1 = shown[0][2] - margin, shown[-1][2] + shown[-1][3] + margin
    for lane, name, start, dur in sorted(row["trace"], key=lambda e: -e[3]):  # nested phases on top
        if start + dur < t0 or start > t1:
            continue
        color = PHASE_COLORS.get(name, "tab:orange") if lane == 1 else "tab:orange"
        ax.broken_barh(
            [(start - t0, max(dur, 0.002 * (t1 - t0)))],
            (2 - lane + 0.1, 0.8),
            facecolor=color,
            edgecolor="white",
            linewidth=0.5,
        )
    order = "overlap" if row["overlap_step_order"] else "normal"
    ax.set(xlim=(0, t1 - t0), ylim=(0, 2), yticks=[0.5, 1.5], yticklabels=["forward", "scheduler"])
    ax.set_title(
        f"{row['model']} bs {row['bs']}: {row['loop']} loop (ran the {order} step order), ms",
        fontsize=8,
        loc="left",
    )
    ax.tick_params(labelsize=7)
    if legend:
        handles = [Patch(color=c, label=n) for n, c in PHASE_COLORS.items()]
        ax.legend(
            handles=handles,
            fontsize=6,
            ncol=len(handles),
            loc="lower right",
            bbox_to_anchor=(1.0, 1.0),
            frameon=False,
        )


def bench_model(args, model: str, sizes: list[int], traced_bs: int, tmp: Path) -> list[dict]:
    path, load_format = model_folder(model, tmp)
    model_args = dict(
        model_path=path,
        load_format=load_format,
        device=args.device,
        dtype=args.dtype,
        max_total_tokens=max(sizes) * (args.prompt_len + args.new_tokens) * 2 + 1024,
        max_running_requests=max(sizes),
        num_threads=args.num_threads,
        cpu_forward_stream=args.cpu_layout,
    )
    worker = TimedWorker(TpModelWorker(ServerArgs(**model_args)))
    if args.no_finite_check:
        worker.model_runner.sampler.check_finite = False
    vocab = worker.get_worker_info().vocab_size
    results = []
    for bs in sizes:

        def run(loop: str, bs: int = bs) -> dict:
            trace_dir = Path(args.trace_dir) if args.trace_dir else tmp
            trace_file = (
                str(trace_dir / f"trace_{Path(model).name}_bs{bs}_{loop}.json") if bs == traced_bs else None
            )
            return run_once(args, worker, model_args, bs, loop == "overlap", vocab, trace_file)

        pair = best_of(args.repeats, run)
        for r in pair.values():
            r["model"] = model
            results.append(r)
        n, o = pair["normal"], pair["overlap"]
        print(
            f"{model:<8} {bs:>4} | {n['tokens_per_s']:>12.0f} {o['tokens_per_s']:>13.0f} "
            f"{o['tokens_per_s'] / n['tokens_per_s']:>6.2f} | {n['step_ms']:>6.2f} {o['step_ms']:>6.2f} | "
            f"{n['sched_cpu_ms']:>7.3f} {o['sched_cpu_ms']:>8.3f} | {n['device_idle']:>5.1%} {o['device_idle']:>5.1%}",
            flush=True,
        )
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,smollm2", help="shapes of model_shapes.py or HF folders")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch-sizes", default="1,8,32,64,128")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="runs per loop and batch size; the fastest is kept")
    p.add_argument("--num-threads", type=int, default=None, help="CPU intra-op threads")
    p.add_argument(
        "--cpu-layout",
        default="auto",
        choices=CPU_FORWARD_STREAMS,
        help="where the CPU forward runs (the engine's --cpu-forward-stream)",
    )
    p.add_argument(
        "--timeline-bs",
        type=int,
        default=8,
        help="batch size whose runs are traced for the plot's timeline (else the smallest)",
    )
    p.add_argument(
        "--no-finite-check", action="store_true", help="skip the sampler's NaN check (a device sync)"
    )
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--trace-dir", default=None, help="keep the traced runs' Chrome traces here")
    args = p.parse_args()
    if args.trace_dir:
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)

    tmp = Path(tempfile.mkdtemp())
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    traced_bs = args.timeline_bs if args.timeline_bs in sizes else min(sizes)
    results = []
    load_before = os.getloadavg()
    print(
        f"device={args.device} prompt={args.prompt_len} new_tokens={args.new_tokens} "
        f"threads={args.num_threads or torch.get_num_threads()} cpu_layout={args.cpu_layout} "
        f"load average {' '.join(f'{x:.2f}' for x in load_before)}"
    )
    print(
        f"{'model':<8} {'bs':>4} | {'normal tok/s':>12} {'overlap tok/s':>13} {'ratio':>6} | "
        f"{'step ms n/o':>13} | {'sched cpu ms n/o':>16} | {'idle n/o':>11}"
    )
    for model in args.models.split(","):
        results += bench_model(args, model, sizes, traced_bs, tmp)
    load_after = os.getloadavg()
    print(f"load average {' '.join(f'{x:.2f}' for x in load_after)}")
    if args.out:
        meta = {
            "load_average_before": load_before,
            "load_average_after": load_after,
            "time": time.ctime(),
            "torch": torch.__version__,
            "cores": os.cpu_count(),
        }
        Path(args.out).write_text(
            json.dumps({"args": vars(args), "meta": meta, "results": results}, indent=2)
        )
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
