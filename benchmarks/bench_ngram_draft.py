"""Cost of NGRAM drafting and of draft verification on the CPU, per call.

    python benchmarks/bench_ngram_draft.py [--context 2048] [--calls 2000]

Drafting: one `NgramIndex.draft()` over a context of `--context` tokens (a copy-heavy text: a
paragraph of random tokens repeated with edits, so matches exist; and random tokens, the worst
case for candidates), chain and tree; one `append` of a token between calls, as decoding does.
Verification: `verify_tree` on [bs, n, vocab] logits (greedy, and sampled with top-p)."""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from radixengine.layers.sampler import Sampler
from radixengine.sampling.sampling_batch_info import SamplingBatchInfo
from radixengine.sampling.sampling_params import SamplingParams
from radixengine.speculative.ngram_index import NgramIndex, NgramParams, SharedNgramIndex
from radixengine.speculative.spec_tree import DraftTrees
from radixengine.speculative.spec_verify import verify_tree


def copy_heavy_context(length: int, vocab: int, rng: np.random.Generator) -> np.ndarray:
    paragraph = rng.integers(0, vocab, size=200)
    out = []
    while len(out) < length:
        edited = paragraph.copy()
        edited[rng.integers(0, len(edited), size=5)] = rng.integers(0, vocab, size=5)
        out.extend(edited.tolist())
    return np.asarray(out[:length])


def time_drafts(context: np.ndarray, params: NgramParams, calls: int, shared=None) -> tuple[float, float]:
    """(µs per draft, mean drafted tokens)."""
    index = NgramIndex(params, context[: len(context) - calls])
    tail = context[len(context) - calls :].tolist()
    drafted = 0
    start = time.perf_counter()
    for token in tail:
        index.append([token])
        drafted += index.draft([shared] if shared is not None else []).num_nodes - 1
    return (time.perf_counter() - start) / calls * 1e6, drafted / calls


def _ms(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def time_verify(bs: int, n: int, vocab: int, sampled: bool, reps: int = 10) -> tuple[float, float]:
    """(ms per verify_tree call, ms of the plain Sampler on the same bs * n rows). Logits with a
    spread like a model's (a few likely tokens), so top-p keeps a small nucleus."""
    logits = torch.randn(bs, n, vocab) * 4
    params = SamplingParams(temperature=0.7, top_p=0.9) if sampled else SamplingParams(temperature=0)
    info = SamplingBatchInfo.from_sampling_params([params] * bs, [0] * bs, "cpu", vocab)
    flat_info = SamplingBatchInfo.from_sampling_params([params] * (bs * n), [0] * (bs * n), "cpu", vocab)
    trees = DraftTrees.chains(torch.randint(0, vocab, (bs, n)), [n] * bs)
    verify_ms = _ms(lambda: verify_tree(logits.clone(), trees, info), reps)
    plain_ms = _ms(lambda: Sampler()(logits.view(bs * n, vocab).clone(), flat_info), reps)
    return verify_ms, plain_ms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--vocab", type=int, default=49152)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    total = args.context + args.calls
    texts = {
        "copy-heavy": copy_heavy_context(total, args.vocab, rng),
        "random": rng.integers(0, 50, size=total),
    }
    configs = {
        "chain n=8": NgramParams(num_draft_tokens=8),
        "tree n=16 breadth 4 branch 8": NgramParams(
            num_draft_tokens=16, max_bfs_breadth=4, max_branch_length=8
        ),
    }
    print(f"drafting over a {args.context}-token context ({args.calls} calls, one append each):")
    for text_name, text in texts.items():
        for name, params in configs.items():
            us, mean = time_drafts(text[: args.context + args.calls], params, args.calls)
            print(f"  {text_name:10s} {name:30s} {us:7.1f} us/draft  {mean:5.2f} tokens drafted")
    shared = SharedNgramIndex(capacity=1 << 20)
    shared.insert(texts["copy-heavy"])
    us, mean = time_drafts(texts["random"], configs["chain n=8"], args.calls, shared)
    print(
        f"  random + shared index (1M)  chain n=8             {us:7.1f} us/draft  {mean:5.2f} tokens drafted"
    )
    print(f"verify_tree, vocab {args.vocab}, n=8 (against the plain Sampler on the same bs * 8 rows):")
    for bs in (1, 8, 32):
        for sampled in (False, True):
            verify_ms, plain_ms = time_verify(bs, 8, args.vocab, sampled)
            kind = "top-p 0.9" if sampled else "greedy"
            print(f"  bs={bs:3d} {kind:9s} verify {verify_ms:8.2f} ms   sampler {plain_ms:8.2f} ms")


if __name__ == "__main__":
    main()
