"""Tensor parallel on a CPU: decode throughput of the default model (SmolLM2-135M-Instruct) with
one rank and with two (gloo), and the share of a two-rank decode step spent in communication.

    python benchmarks/bench_tp.py --out bench_results/tp.json
    python benchmarks/bench_tp.py --tp-sizes 1,2 --batch 8 --new-tokens 64 --dtype auto

Throughput: one Engine per TP size (threads: the machine's cores shared by the ranks, the
default) decodes `--batch` requests of `--new-tokens` greedy tokens after short prompts; decode
tok/s is the output tokens over the wall time from the first token of the batch to the last (the
prefill left out), median of `--repeats` rounds after one warm-up round. Communication share: two
rank processes run the model's decode steps through `ModelRunner` (the scheduler's forward and
sampling path), with every all-reduce / all-gather of the layers timed; reported per rank as the
collective seconds over the step seconds (a collective's time includes waiting for the other
rank: with 9 query heads split 3 / 6, rank 0 waits for rank 1)."""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # model_utils' ModelDriver: the scheduler's batch layout

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Once upon a time",
    "The quick brown fox",
    "Explain gravity in one sentence.",
    "def fibonacci(n):",
    "My favourite colour is",
]


def engine_decode_tps(tp_size: int, args) -> dict:
    from radixengine import Engine

    engine = Engine(
        tp_size=tp_size, dtype=args.dtype, num_threads=args.threads, log_level="warning", random_seed=0
    )
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]
    params = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}

    async def one_round() -> tuple[float, list[list[int]]]:
        first, last, outputs = [], [], []

        async def stream(prompt: str) -> None:
            ids: list[int] = []
            async for chunk in await engine.async_generate(prompt, params, stream=True):
                now = time.perf_counter()
                if not ids:
                    first.append(now)
                ids = chunk["output_ids"]
            last.append(time.perf_counter())
            outputs.append(ids)

        await asyncio.gather(*(stream(p) for p in prompts))
        decoded = args.batch * (args.new_tokens - 1)
        return decoded / (max(last) - max(first)), outputs

    try:
        asyncio.run(one_round())  # warm-up
        rounds = [asyncio.run(one_round()) for _ in range(args.repeats)]
    finally:
        engine.shutdown()
    return {
        "tp_size": tp_size,
        "decode_tok_s": statistics.median(tps for tps, _ in rounds),
        "rounds_tok_s": [round(tps, 1) for tps, _ in rounds],
        "outputs": sorted(rounds[-1][1]),
    }


def _profile_rank(rank: int, port: int, args, results) -> None:
    from model_utils import ModelDriver

    import radixengine.layers.linear as linear
    import radixengine.layers.vocab_embedding as vocab
    from radixengine.distributed import init_distributed
    from radixengine.model_executor.model_runner import ModelRunner
    from radixengine.server_args import ServerArgs

    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    comm = [0.0]

    def timed(fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            comm[0] += time.perf_counter() - start
            return out

        return wrapper

    linear.tensor_model_parallel_all_reduce = timed(linear.tensor_model_parallel_all_reduce)
    vocab.tensor_model_parallel_all_reduce = timed(vocab.tensor_model_parallel_all_reduce)
    vocab.tensor_model_parallel_all_gather = timed(vocab.tensor_model_parallel_all_gather)
    init_distributed(2, rank, f"tcp://127.0.0.1:{port}")
    runner = ModelRunner(
        ServerArgs(dtype=args.dtype, num_threads=threads, max_total_tokens=4096, random_seed=0)
    )
    driver = ModelDriver(runner)
    rids = [f"r{i}" for i in range(args.batch)]
    logits = driver.extend({rid: [1, 504, 3458, 282, 4649 + i] for i, rid in enumerate(rids)})
    tokens = logits.argmax(-1).tolist()
    for _ in range(4):  # warm-up steps
        tokens = driver.decode(dict(zip(rids, tokens))).argmax(-1).tolist()
    comm[0] = 0.0
    start = time.perf_counter()
    for _ in range(args.profile_steps):
        tokens = driver.decode(dict(zip(rids, tokens))).argmax(-1).tolist()
    total = time.perf_counter() - start
    isolated = _isolated_collectives_ms(runner, args.batch)
    results.put(
        {
            "rank": rank,
            "kv_heads": runner.num_kv_heads,
            "step_ms": 1e3 * total / args.profile_steps,
            "comm_ms": 1e3 * comm[0] / args.profile_steps,
            "comm_share": comm[0] / total,
            "isolated_comm_ms": isolated,
            "isolated_comm_share": isolated / (1e3 * total / args.profile_steps),
        }
    )


def _isolated_collectives_ms(runner, batch: int, repeats: int = 50) -> float:
    """The collectives of one decode step run back to back on their own (no compute between them,
    so little waiting for the other rank): 2 all-reduces of `[batch, hidden]` a layer and one for
    the embedding, one all-gather of the logits."""
    import torch.distributed as dist

    from radixengine.distributed import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce

    c = runner.model_config
    hidden = torch.zeros(batch, c.hf_config.hidden_size, dtype=runner.dtype)
    logits = torch.zeros(batch, runner.model.lm_head.weight.shape[0], dtype=runner.dtype)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        for _ in range(2 * c.num_hidden_layers + 1):
            tensor_model_parallel_all_reduce(hidden)
        tensor_model_parallel_all_gather(logits)
    return 1e3 * (time.perf_counter() - start) / repeats


def profile_communication(args) -> list[dict]:
    from radixengine.utils.network import get_free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = get_free_port()
    procs = [ctx.Process(target=_profile_rank, args=(r, port, args, results)) for r in range(2)]
    for p in procs:
        p.start()
    out = sorted((results.get(timeout=1800) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    return out


def machine() -> dict:
    cpu = platform.processor()
    try:
        import subprocess

        lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "load_average": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tp-sizes", default="1,2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="per rank; default: cores / ranks")
    parser.add_argument("--skip-profile", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = {"machine": machine(), "args": vars(args), "runs": []}
    for tp in (int(t) for t in args.tp_sizes.split(",")):
        run = engine_decode_tps(tp, args)
        report["runs"].append(run)
        print(f"TP={tp}: decode {run['decode_tok_s']:.1f} tok/s (rounds {run['rounds_tok_s']})", flush=True)
    outs = [run.pop("outputs") for run in report["runs"]]
    report["same_tokens_as_tp1"] = [o == outs[0] for o in outs]
    report["communication"] = [] if args.skip_profile else profile_communication(args)
    for r in report["communication"]:
        print(
            f"rank {r['rank']}: step {r['step_ms']:.1f} ms, collectives {r['comm_ms']:.1f} ms "
            f"({100 * r['comm_share']:.0f}%); the same collectives alone {r['isolated_comm_ms']:.1f} ms "
            f"({100 * r['isolated_comm_share']:.0f}%)",
            flush=True,
        )
    report["machine"]["load_average_after"] = os.getloadavg()
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
