"""What each scheduling policy does on a shared-prefix workload: prompt tokens computed, tokens
served from the radix cache, and the cache hit rate, with in-batch prefix caching on and off.

    python benchmarks/bench_policies.py                      # tiny random-weight Llama (seconds)
    python benchmarks/bench_policies.py --model default      # the bundled SmolLM2-135M
    python benchmarks/bench_policies.py --model PATH --max-total-tokens 4096 --out results.json

Workload (token ids, no tokenizer): tenants, each with a system prompt; under each, conversations
that share a history; each request = system + history + its own question. The requests arrive in
waves with tenants interleaved, and the KV pool holds only part of the tenants' prefixes at once,
so the order a policy picks decides how much is recomputed. Output lengths are fixed
(ignore_eos), so the counts do not depend on the model's weights. `ideal` = every token an
earlier request of the workload already has (at least one token recomputed per request).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from radixengine.managers.io_struct import BatchTokenIDOut, TokenizedGenerateReqInput  # noqa: E402
from radixengine.managers.scheduler import Scheduler  # noqa: E402
from radixengine.managers.scheduler_io import InProcessIO  # noqa: E402
from radixengine.sampling.sampling_params import SamplingParams  # noqa: E402
from radixengine.server_args import ServerArgs  # noqa: E402

POLICIES = ["fcfs", "lpm", "dfs-weight", "lof", "random"]


def build_tiny_model(folder: Path) -> str:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=2048,
    )
    config.architectures = ["LlamaForCausalLM"]
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def make_workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    per_tenant = []
    for _ in range(args.tenants):
        system = tokens(args.system_len)
        convs = [system + tokens(args.history_len) for _ in range(args.conversations)]
        per_tenant.append(
            [rng.choice(convs) + tokens(rng.randint(8, 32)) for _ in range(args.requests_per_tenant)]
        )
    # interleave tenants: the arrival order is the worst case for FCFS
    return [per_tenant[t][i] for i in range(args.requests_per_tenant) for t in range(args.tenants)]


def ideal_cached_tokens(prompts: list[list[int]]) -> int:
    root: dict = {}
    total = 0
    for ids in prompts:
        node, shared = root, 0
        for t in ids:
            if t not in node:
                break
            node, shared = node[t], shared + 1
        total += min(shared, len(ids) - 1)
        node = root
        for t in ids:
            node = node.setdefault(t, {})
    return total


def run_policy(args, model_path: str, prompts: list[list[int]], policy: str, in_batch: bool, worker) -> dict:
    server_args = ServerArgs(
        model_path=model_path,
        dtype="float32",
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        schedule_policy=policy,
        disable_in_batch_prefix_caching=not in_batch,
        disable_overlap_schedule=True,
        num_threads=args.num_threads,
    )
    req_pool, allocator = worker.get_memory_pool()
    req_pool.clear()
    allocator.clear()
    sched = Scheduler(server_args, tp_worker=worker, io=InProcessIO())
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)
    reqs = [TokenizedGenerateReqInput(f"r{i}", None, p, params) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    for i in range(0, len(reqs), args.wave):
        sched.io.put(*reqs[i : i + args.wave])
        for _ in range(args.steps_between_waves):
            sched.process_input_requests(sched.recv_requests())
            sched.run_step()
    sched.run_until_idle()
    elapsed = time.perf_counter() - start
    finished = sum(
        1 for m in sched.io.take_outputs() if isinstance(m, BatchTokenIDOut) for f in m.finished_reasons if f
    )
    assert finished == len(reqs)
    s = sched.stats
    return {
        "policy": policy,
        "in_batch_prefix_caching": in_batch,
        "prefill_tokens": s.num_prefill_tokens,
        "cached_tokens": s.num_cached_tokens,
        "cache_hit_rate": round(s.cache_hit_rate, 4),
        "retracted": s.num_retracted_reqs,
        "steps": s.num_forward_steps,
        "seconds": round(elapsed, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="'tiny' (random weights), 'default' (SmolLM2) or a path")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--tenants", type=int, default=6)
    p.add_argument("--system-len", type=int, default=160)
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--history-len", type=int, default=96)
    p.add_argument("--requests-per-tenant", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--wave", type=int, default=24, help="requests arriving together")
    p.add_argument("--steps-between-waves", type=int, default=4)
    p.add_argument("--max-total-tokens", type=int, default=2048)
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file for the results")
    args = p.parse_args()

    from radixengine.model_executor.tp_worker import TpModelWorker

    tmp = tempfile.TemporaryDirectory()
    model_path = {"tiny": None, "default": None}.get(args.model, args.model)
    if args.model == "tiny":
        model_path = build_tiny_model(Path(tmp.name))
    worker = TpModelWorker(
        ServerArgs(
            model_path=model_path,
            dtype="float32",
            max_total_tokens=args.max_total_tokens,
            max_running_requests=args.max_running_requests,
            num_threads=args.num_threads,
        )
    )
    vocab = worker.get_worker_info().vocab_size
    prompts = make_workload(args, vocab)
    total_prompt = sum(len(x) for x in prompts)
    ideal = ideal_cached_tokens(prompts)
    print(
        f"model={args.model} requests={len(prompts)} prompt_tokens={total_prompt} "
        f"ideal_cached={ideal} (hit rate {ideal / total_prompt:.3f}) pool={args.max_total_tokens}"
    )
    rows = []
    header = f"{'policy':<11} {'in-batch':>8} {'prefill':>8} {'cached':>8} {'hit rate':>8} {'vs ideal':>8} {'retract':>7} {'steps':>6} {'s':>6}"
    print(header)
    for policy in args.policies.split(","):
        for in_batch in (True, False):
            r = run_policy(args, model_path, prompts, policy, in_batch, worker)
            r["cached_vs_ideal"] = round(r["cached_tokens"] / ideal, 4) if ideal else None
            rows.append(r)
            print(
                f"{policy:<11} {'on' if in_batch else 'off':>8} {r['prefill_tokens']:>8} {r['cached_tokens']:>8} "
                f"{r['cache_hit_rate']:>8.3f} {r['cached_vs_ideal']:>8.3f} {r['retracted']:>7} {r['steps']:>6} "
                f"{r['seconds']:>6.1f}"
            )
    if args.out:
        meta = {k: v for k, v in vars(args).items() if k != "out"}
        Path(args.out).write_text(
            json.dumps(
                {"args": meta, "ideal_cached": ideal, "prompt_tokens": total_prompt, "results": rows},
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
