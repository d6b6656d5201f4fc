"""RadixCache micro-benchmark (CPU).

1. Workload: N requests from a shared-prefix distribution (system prompts x conversations x turns),
   each run through match -> lock -> evict/alloc -> insert -> unlock under a bounded KV pool.
   Reports ops/s and per-op latency of match and insert, hit rate and evictions.
2. Growth: per-op time of match (at fixed matched lengths) and insert as the tree grows from 1k to
   100k nodes. A match walks only the nodes of the matched path, so its cost follows the matched
   length, not the tree size.
3. Edge compare: the cost of comparing one edge as a tuple slice (what the tree does) against a
   torch or numpy compare.

    python benchmarks/bench_radix_cache.py [--num-requests 20000] [--out bench_results/radix_cache.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from radixengine.mem_cache.accounting import check_token_accounting
from radixengine.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixengine.mem_cache.radix_cache import RadixCache

# ---- 1. workload ----


@dataclass
class Conversation:
    history: list[int]
    turns_left: int


@dataclass
class WorkloadResult:
    page_size: int
    num_requests: int
    pool_size: int
    prompt_tokens: int = 0
    matched_tokens: int = 0
    evicted_tokens: int = 0
    alloc_failures: int = 0
    wall_s: dict[str, float] = field(default_factory=lambda: {"match": 0.0, "insert": 0.0, "evict": 0.0})
    cpu_us: dict[str, list[float]] = field(default_factory=lambda: {"match": [], "insert": [], "evict": []})
    final_nodes: int = 0

    def summary(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("cpu_us", "wall_s")}
        for name, samples in self.cpu_us.items():
            lat = sorted(samples) or [0.0]
            out[f"{name}_count"] = len(samples)
            out[f"{name}_ops_per_cpu_s"] = len(samples) / max(sum(samples) / 1e6, 1e-9)
            out[f"{name}_ops_per_wall_s"] = len(samples) / max(self.wall_s[name], 1e-9)
            out[f"{name}_p50_us"] = lat[len(lat) // 2]
            out[f"{name}_p99_us"] = lat[int(len(lat) * 0.99)]
        out["hit_rate"] = self.matched_tokens / max(self.prompt_tokens, 1)
        out["mean_prompt_tokens"] = self.prompt_tokens / self.num_requests
        return out

    def record(self, name: str, wall0: float, cpu0: float) -> None:
        self.wall_s[name] += time.perf_counter() - wall0
        self.cpu_us[name].append((time.thread_time() - cpu0) * 1e6)


class ConversationSource:
    """Requests of multi-turn conversations that start from one of a few system prompts."""

    def __init__(self, rng: random.Random, vocab: int, num_system: int, active: int):
        self.rng, self.vocab = rng, vocab
        self.system_prompts = [self.tokens(rng.randint(100, 1000)) for _ in range(num_system)]
        self.active = [self.new_conversation() for _ in range(active)]

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def new_conversation(self) -> Conversation:
        return Conversation(list(self.rng.choice(self.system_prompts)), self.rng.randint(2, 12))

    def next_request(self) -> tuple[list[int], list[int]]:
        """(prompt, prompt + reply) of the next turn of a random conversation."""
        i = self.rng.randrange(len(self.active))
        conv = self.active[i]
        prompt = conv.history + self.tokens(self.rng.randint(10, 150))
        full = prompt + self.tokens(self.rng.randint(10, 400))
        conv.history, conv.turns_left = full, conv.turns_left - 1
        if conv.turns_left == 0:
            self.active[i] = self.new_conversation()
        return prompt, full


def count_nodes(tree: RadixCache) -> int:
    count, stack = 0, list(tree.root_node.children.values())
    while stack:
        node = stack.pop()
        count += 1
        stack.extend(node.children.values())
    return count


def make_allocator(size: int, page_size: int):
    if page_size == 1:
        return TokenToKVPoolAllocator(size, torch.float16, "cpu", None)
    return PagedTokenToKVPoolAllocator(size, page_size, torch.float16, "cpu", None)


def run_workload(num_requests: int, pool_size: int, page_size: int, seed: int) -> WorkloadResult:
    rng = random.Random(seed)
    source = ConversationSource(rng, vocab=32000, num_system=16, active=128)
    alloc = make_allocator(pool_size, page_size)
    tree = RadixCache(None, alloc, page_size)
    res = WorkloadResult(page_size, num_requests, pool_size)
    wall, cpu = time.perf_counter, time.thread_time
    for _ in range(num_requests):
        prompt, full = source.next_request()
        w0, c0 = wall(), cpu()
        match = tree.match_prefix(prompt)
        res.record("match", w0, c0)
        res.prompt_tokens += len(prompt)
        res.matched_tokens += len(match.device_indices)

        tree.inc_lock_ref(match.last_node)
        need = -(-(len(full) - len(match.device_indices)) // page_size) * page_size
        if need > alloc.available_size():
            w0, c0 = wall(), cpu()
            res.evicted_tokens += tree.evict(need - alloc.available_size())
            res.record("evict", w0, c0)
        slots = alloc.alloc(need)
        if slots is None:
            res.alloc_failures += 1
        else:
            value = torch.cat((match.device_indices, slots))[: len(full)]
            aligned = len(full) // page_size * page_size
            w0, c0 = wall(), cpu()
            present = tree.insert(full, value)
            res.record("insert", w0, c0)
            alloc.free(value[len(match.device_indices) : present])
            alloc.free(slots[aligned - len(match.device_indices) :])  # the unaligned tail page
        tree.dec_lock_ref(match.last_node)
    check_token_accounting(alloc, tree, None)
    res.final_nodes = count_nodes(tree)
    return res


# ---- 2. growth ----


def timed_us(fn, reps: int, rounds: int = 7) -> float:
    """Median over rounds of the mean time of one call, in microseconds."""
    return statistics.median(time_round_us(fn, reps) for _ in range(rounds))


def time_round_us(fn, reps: int) -> float:
    """Mean CPU time of one call: the machine is shared, and wall time includes waiting."""
    t0 = time.thread_time()
    for _ in range(reps):
        fn()
    return (time.thread_time() - t0) / reps * 1e6


@dataclass
class GrownTree:
    tree: RadixCache
    probe: list[int]
    reservoir: list[list[int]]
    rng: random.Random


def grow_tree(num_nodes: int, probe_len: int, seed: int) -> GrownTree:
    """Random branching sequences (token ids < 256, so Python shares the int objects) beside a
    probe path (ids 256..511) with a branch every 128 tokens; the probe's path is the same in
    every tree, whatever its size."""
    rng = random.Random(seed)
    tree = RadixCache(None, None, 1)
    probe = [rng.randrange(256, 512) for _ in range(probe_len)]
    tree.insert(probe)
    for cut in range(128, len(probe), 128):
        tree.insert(probe[:cut] + [rng.randrange(256, 512) for _ in range(8)])
    reservoir = [[rng.randrange(256) for _ in range(64)]]
    values = torch.arange(512)  # stand-in KV slots
    nodes = count_nodes(tree)
    while nodes < num_nodes:
        for _ in range(max(200, (num_nodes - nodes) // 2)):
            base = rng.choice(reservoir)
            cut = rng.randint(0, min(len(base), 448))
            doc = base[:cut] + [rng.randrange(256) for _ in range(rng.randint(16, 64))]
            tree.insert(doc, values[: len(doc)])
            if len(reservoir) < 2000:
                reservoir.append(doc)
            else:
                reservoir[rng.randrange(2000)] = doc
        nodes = count_nodes(tree)
    return GrownTree(tree, probe, reservoir, rng)


def insert_round_us(grown: GrownTree, count: int = 30) -> float:
    """Insert 64 cached tokens + 64 new ones (each adds a split and a leaf)."""
    docs = []
    for _ in range(count):
        base = grown.rng.choice([d for d in grown.rng.sample(grown.reservoir, 8) if len(d) >= 64])
        docs.append(base[:64] + [grown.rng.randrange(256) for _ in range(64)])
    value = torch.arange(128)
    t0 = time.thread_time()
    for doc in docs:
        grown.tree.insert(doc, value)
    return (time.thread_time() - t0) / count * 1e6


def run_growth(tree_sizes: list[int], match_lens: list[int], seed: int, rounds: int = 9) -> list[dict]:
    """Build one tree per size, then time them round-robin, so a change in machine load hits all
    sizes alike; report the median round."""
    trees = [grow_tree(size, max(match_lens) + 1, seed) for size in tree_sizes]
    nodes_before = [count_nodes(grown.tree) for grown in trees]
    queries = {"match_miss_us": [1000, 1, 2]}  # no such first token
    queries |= {f"match_{n}_us": None for n in match_lens}
    samples: list[dict[str, list[float]]] = [{} for _ in trees]
    for _ in range(rounds):
        for grown, sample in zip(trees, samples):
            for name, query in queries.items():
                length = int(name.split("_")[1]) if query is None else 0
                query = query or grown.probe[:length] + [1000]
                assert len(grown.tree.match_prefix(query).device_indices) == length
                reps = max(20, 20000 // max(length, 10))
                sample.setdefault(name, []).append(
                    time_round_us(lambda q=query, t=grown.tree: t.match_prefix(q), reps)
                )
            sample.setdefault("insert_128_us", []).append(insert_round_us(grown))
    rows = []
    for grown, sample, nodes in zip(trees, samples, nodes_before):
        row: dict = {"tree_nodes": nodes, "nodes_after_inserts": count_nodes(grown.tree)}
        row["tree_tokens"] = grown.tree.total_size()
        row |= {name: statistics.median(values) for name, values in sample.items()}
        row["min_us"] = {name: min(values) for name, values in sample.items()}
        rows.append(row)
    return rows


# ---- 3. edge compare ----


def run_compare(lengths: list[int], seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [compare_edge([rng.randrange(32000) for _ in range(n)]) for n in lengths]


def compare_edge(tokens: list[int]) -> dict:
    """One edge of len(tokens) compared against an equal slice of a request's key, four ways."""
    n = len(tokens)
    stored, key = tuple(tokens), (0, *tokens)  # the tree compares a slice of the request's key
    x_stored, x_key = torch.tensor(tokens), torch.tensor(key)
    n_stored, n_key = np.array(tokens), np.array(key)
    reps = max(50, 100000 // n)
    return {
        "edge_tokens": n,
        "tuple_slice_us": timed_us(lambda: key[1 : 1 + n] == stored, reps),
        "torch_equal_us": timed_us(lambda: torch.equal(x_key[1 : 1 + n], x_stored), reps),
        "numpy_equal_us": timed_us(lambda: np.array_equal(n_key[1 : 1 + n], n_stored), reps),
        "list_to_tensor_us": timed_us(lambda: torch.tensor(tokens), reps),
    }


# ---- output ----


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    lines = ["| " + " | ".join(title for _, title, _ in columns) + " |"]
    lines.append("|" + "|".join("---:" for _ in columns) + "|")
    for row in rows:
        lines.append("| " + " | ".join(format(row[key], fmt) for key, _, fmt in columns) + " |")
    return "\n".join(lines)


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=20000)
    parser.add_argument("--pool-size", type=int, default=200_000, help="KV pool size in tokens")
    parser.add_argument("--page-sizes", default="1,16")
    parser.add_argument("--tree-sizes", default="1000,10000,100000")
    parser.add_argument("--match-lens", default="16,256,4096")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_results/radix_cache.json")
    args = parser.parse_args()
    workload = [
        run_workload(args.num_requests, args.pool_size, ps, args.seed).summary()
        for ps in ints(args.page_sizes)
    ]
    print(f"## Workload: {args.num_requests} requests, pool {args.pool_size} tokens (CPU time per op)\n")
    print(
        markdown_table(
            workload,
            [
                ("page_size", "page size", "d"),
                ("mean_prompt_tokens", "prompt tokens (mean)", ",.0f"),
                ("hit_rate", "hit rate", ".1%"),
                ("match_ops_per_cpu_s", "match ops/s", ",.0f"),
                ("match_p50_us", "match p50 µs", ".1f"),
                ("match_p99_us", "match p99 µs", ".1f"),
                ("insert_ops_per_cpu_s", "insert ops/s", ",.0f"),
                ("insert_p50_us", "insert p50 µs", ".1f"),
                ("insert_p99_us", "insert p99 µs", ".1f"),
                ("evict_count", "evict calls", ",d"),
                ("evict_p50_us", "evict p50 µs", ".1f"),
                ("evicted_tokens", "evicted tokens", ",d"),
                ("final_nodes", "nodes at end", ",d"),
            ],
        )
    )

    match_lens = ints(args.match_lens)
    growth = run_growth(ints(args.tree_sizes), match_lens, args.seed)
    print("\n## CPU time per op (µs) as the tree grows, page size 1\n")
    columns = [("tree_nodes", "tree nodes", ",d"), ("match_miss_us", "match, 0 matched", ".1f")]
    columns += [(f"match_{n}_us", f"match, {n} matched", ".1f") for n in match_lens]
    columns += [("insert_128_us", "insert 128 (64 new)", ".1f")]
    print(markdown_table(growth, columns))

    compare = run_compare([16, 256, 4096], args.seed)
    print("\n## Comparing one edge (CPU µs)\n")
    print(
        markdown_table(
            compare,
            [
                ("edge_tokens", "edge tokens", "d"),
                ("tuple_slice_us", "tuple slice ==", ".2f"),
                ("torch_equal_us", "torch.equal", ".2f"),
                ("numpy_equal_us", "np.array_equal", ".2f"),
                ("list_to_tensor_us", "list -> tensor", ".2f"),
            ],
        )
    )

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "workload": workload,
        "growth": growth,
        "edge_compare": compare,
    }
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
