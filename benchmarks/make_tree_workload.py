"""Writes benchmarks/workloads/W3.jsonl: a prefix *tree*, in the spirit of SGLang's
generated-shared-prefix dataset: 4 system prompts x 4 users (each with a two-turn history of their
own) x 2 new questions = 32 chat requests, 64 new tokens each (greedy, ignore_eos). Requests share
a system prompt in groups of 8, and a user's history in pairs: three levels of sharing.

    python benchmarks/make_tree_workload.py            # deterministic (seed 0)
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "workloads" / "W3.jsonl"
TOPICS = ("billing", "shipping", "returns", "warranty", "accounts", "repairs", "rentals", "events")
WORDS = (
    "order customer policy refund package delivery invoice account support product warranty "
    "repair exchange store online payment receipt address schedule member discount service "
    "request ticket agent manual battery device charger cable screen setting update password"
).split()


def sentences(rng: random.Random, n: int) -> str:
    return " ".join(
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 14))).capitalize() + "." for _ in range(n)
    )


def system_prompt(rng: random.Random, topic: str) -> str:
    rules = " ".join(f"{i}. {sentences(rng, 2)}" for i in range(1, 13))
    return f"You are the {topic} assistant of an online store. Follow these rules in every reply. {rules}"


def build(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    items = []
    for topic in TOPICS[:4]:
        system = system_prompt(rng, topic)
        for _ in range(4):
            history = []
            for _ in range(2):
                history.append({"role": "user", "content": sentences(rng, 2) + "?"})
                history.append({"role": "assistant", "content": sentences(rng, 3)})
            for _ in range(2):
                question = {"role": "user", "content": sentences(rng, 1) + "?"}
                items.append(
                    {
                        "messages": [{"role": "system", "content": system}, *history, question],
                        "sampling_params": {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True},
                    }
                )
    return items


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=str(OUT))
    args = p.parse_args()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        for item in build(args.seed):
            f.write(json.dumps(item) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
