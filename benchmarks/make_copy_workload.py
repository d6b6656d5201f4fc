"""Writes benchmarks/workloads/W4.jsonl: a copy-heavy workload for speculative decoding, whose
answers mostly repeat the prompt. 32 chat requests, generated here (no outside text):

- rewrite: a paragraph to copy with a few word swaps;
- fix: a small Python module with one wrong line, to return corrected in full;
- reformat: a minified JSON document to pretty-print with two-space indentation.

Each line has `messages`, `sampling_params` (greedy, `max_new_tokens` 128, ignore_eos), `kind`,
and `reference`: the ideal answer (what a model that follows the instruction would write).

    python benchmarks/make_copy_workload.py            # deterministic (seed 0)
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "workloads" / "W4.jsonl"
WORDS = (
    "river garden window morning engine letter market winter orchard bridge station lantern "
    "harbor valley teacher student painter kitchen library village mountain forest ladder candle "
    "quietly slowly brightly carefully often always never together again already"
).split()
VERBS = "opens carries watches follows builds paints repairs visits finds keeps".split()
SWAPS = [
    ("river", "stream"),
    ("garden", "yard"),
    ("morning", "dawn"),
    ("market", "bazaar"),
    ("winter", "frost"),
]
NAMES = "ada bruno chen dara emil fatima goran hana ivo jana kofi lena mira nils omar petra".split()
CITIES = "lisbon osaka lagos quito oslo hanoi tunis perth".split()


def paragraph(rng: random.Random, sentences: int) -> str:
    out = []
    for _ in range(sentences):
        a, b, c = rng.sample(WORDS[:24], 3)
        out.append(f"The {a} {rng.choice(VERBS)} the {b} near the {c} {rng.choice(WORDS[24:])}.")
    return " ".join(out)


def rewrite_item(rng: random.Random) -> dict:
    text = paragraph(rng, rng.randint(5, 8))
    present = [s for s in SWAPS if s[0] in text.split()] or [SWAPS[0]]
    swaps = rng.sample(present, min(2, len(present)))
    answer = text
    for old, new in swaps:
        answer = " ".join(new if w == old else w for w in answer.split(" "))
    rules = " and ".join(f"every '{old}' with '{new}'" for old, new in swaps)
    prompt = f"Rewrite the paragraph below word for word, but replace {rules}. Output only the paragraph.\n\n{text}"
    return _item("rewrite", prompt, answer)


def module_lines(rng: random.Random) -> list[str]:
    lines = []
    for i in range(rng.randint(3, 5)):
        name = f"{rng.choice(['sum', 'scale', 'count', 'clip', 'mean'])}_{rng.choice(WORDS[:24])}_{i}"
        k = rng.randint(2, 9)
        lines += [
            f"def {name}(values):",
            "    total = 0",
            "    for v in values:",
            f"        if v > {k}:",
            f"            total = total + v * {k}",
            "    return total",
            "",
        ]
    return lines[:-1]


def fix_item(rng: random.Random) -> dict:
    lines = module_lines(rng)
    targets = [i for i, line in enumerate(lines) if "total = total + v" in line]
    bad = rng.choice(targets)
    broken = list(lines)
    broken[bad] = broken[bad].replace("total + v", "total - v")
    code = "\n".join(broken)
    prompt = (
        f"Line {bad + 1} of this Python file subtracts where it should add. Fix that line and "
        f"output the whole corrected file, nothing else.\n\n```python\n{code}\n```"
    )
    return _item("fix", prompt, "```python\n" + "\n".join(lines) + "\n```")


def json_item(rng: random.Random) -> dict:
    doc = {
        "batch": rng.randint(100, 999),
        "people": [
            {
                "name": n,
                "city": rng.choice(CITIES),
                "age": rng.randint(18, 80),
                "tags": rng.sample(WORDS[:24], 2),
            }
            for n in rng.sample(NAMES, rng.randint(3, 5))
        ],
    }
    prompt = (
        "Reformat this JSON with two-space indentation, keeping every key and value as it is. "
        f"Output only the JSON.\n\n{json.dumps(doc, separators=(',', ':'))}"
    )
    return _item("reformat", prompt, json.dumps(doc, indent=2))


def _item(kind: str, prompt: str, reference: str) -> dict:
    return {
        "messages": [{"role": "user", "content": prompt}],
        "sampling_params": {"max_new_tokens": 128, "temperature": 0, "ignore_eos": True},
        "kind": kind,
        "reference": reference,
    }


def build(seed: int = 0, n: int = 32) -> list[dict]:
    rng = random.Random(seed)
    makers = (rewrite_item, fix_item, json_item)
    return [makers[i % len(makers)](rng) for i in range(n)]


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
