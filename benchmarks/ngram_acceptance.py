"""Offline NGRAM acceptance: how many tokens a verify step would emit on a workload, without a
speculative engine. Greedy speculation emits exactly the plain greedy output, so replaying that
output against the drafts gives the accept lengths exactly: at each step the drafter sees the
prompt and the output so far, and the step emits the deepest draft path equal to the next output
tokens plus one (the bonus).

    python benchmarks/ngram_acceptance.py --workloads W4 --outputs reference   # the ideal answers
    python benchmarks/ngram_acceptance.py --workloads W4,W2 --outputs engine   # the model's greedy output

Prints, per workload and drafter config, tokens per verify step (mean accept length + 1) and the
share of steps that accepted at least one draft token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from radixengine.speculative.ngram_index import NgramDraft, NgramIndex, NgramParams

HERE = Path(__file__).resolve().parent
CONFIGS = {
    "chain n=4": NgramParams(num_draft_tokens=4),
    "chain n=8": NgramParams(num_draft_tokens=8),
    "chain n=16": NgramParams(num_draft_tokens=16),
    "tree n=8 breadth 3": NgramParams(num_draft_tokens=8, max_bfs_breadth=3, max_branch_length=6),
    "tree n=16 breadth 4": NgramParams(num_draft_tokens=16, max_bfs_breadth=4, max_branch_length=8),
}


def accepted(draft: NgramDraft, expected: list[int]) -> int:
    """Depth of the deepest draft path equal to the start of `expected`."""
    node, depth = 0, 0
    while depth < len(expected):
        children = np.flatnonzero((draft.parents == node) & (draft.tokens == expected[depth]))
        if len(children) == 0:
            return depth
        node, depth = int(children[0]), depth + 1
    return depth


def replay(prompt: list[int], output: list[int], params: NgramParams) -> tuple[int, int]:
    """(verify steps, steps with an accepted draft) to emit `output` after `prompt`."""
    index = NgramIndex(params, prompt + output[:1])  # the first token comes from the prefill
    pos, steps, hits = 1, 0, 0
    while pos < len(output):
        n = accepted(index.draft(), output[pos:])
        emitted = min(n + 1, len(output) - pos)
        index.append(output[pos : pos + emitted])
        pos, steps, hits = pos + emitted, steps + 1, hits + (n > 0)
    return steps, hits


def load(name: str, workloads_dir: str) -> list[dict]:
    for folder in (HERE / "workloads", Path(workloads_dir)):
        path = folder / f"{name}.jsonl"
        if path.exists():
            return [
                json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()
            ]
    raise FileNotFoundError(name)


def prompts_and_outputs(items: list[dict], source: str, max_new_tokens: int | None):
    from radixengine import Engine

    with Engine(dtype="float32", log_level="warning") as engine:
        tok = engine.tokenizer
        prompts = [
            tok.encode(
                tok.apply_chat_template(i["messages"], add_generation_prompt=True, tokenize=False),
                add_special_tokens=False,
            )
            for i in items
        ]
        if source == "reference":
            return prompts, [tok.encode(i["reference"], add_special_tokens=False) for i in items]
        params = [
            dict(i["sampling_params"], **({"max_new_tokens": max_new_tokens} if max_new_tokens else {}))
            for i in items
        ]
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        return prompts, [o["output_ids"] for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", default="W4")
    parser.add_argument("--outputs", choices=("reference", "engine"), default="reference")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument(
        "--workloads-dir", default=str(HERE.parent.parent / "shared" / "workloads"), help="W1, W2"
    )
    args = parser.parse_args()
    for name in args.workloads.split(","):
        items = load(name, args.workloads_dir)
        if args.outputs == "reference" and "reference" not in items[0]:
            raise SystemExit(f"{name} has no reference answers; use --outputs engine")
        prompts, outputs = prompts_and_outputs(items, args.outputs, args.max_new_tokens)
        tokens = sum(len(o) - 1 for o in outputs)
        print(f"{name} ({args.outputs} outputs, {len(items)} requests, {tokens} tokens after the first):")
        for label, params in CONFIGS.items():
            steps = hits = 0
            for prompt, output in zip(prompts, outputs):
                s, h = replay(prompt, output, params)
                steps, hits = steps + s, hits + h
            print(
                f"  {label:22s} {tokens / steps:5.2f} tokens/step   {hits / steps:6.1%} steps accept a draft"
            )


if __name__ == "__main__":
    main()
