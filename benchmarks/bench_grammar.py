"""Constrained decoding's cost: 32 json_schema requests vs the same 32 unconstrained, in the normal
and the overlap loop, in one run.

    python benchmarks/bench_grammar.py                          # the default model (SmolLM2 GGUF), CPU
    python benchmarks/bench_grammar.py --device cuda --out bench_results/bench_grammar_gpu.json

The scheduler runs in process over the real model and tokenizer. Per loop: the constrained run
(every output must json.loads and validate against the schema: `invalid` counts those that do
not), then the unconstrained run of the same prompts, each request generating exactly as many
tokens as its constrained twin did (ignore_eos, max_new_tokens = that count): the same batch
shapes step by step. Reported: output tokens/s of both and their ratio, mean step time, the mean
host time per step spent filling the masks (the scheduler's `grammar` phase over the steps that
had one), and how much of that time the loop hides: the share of the mask filling that ran while
the same batch's forward ran (host intervals, on a CPU; 0 in the normal loop by construction).
Each case runs `--repeats` times, alternating, and the fastest run is reported. The grammar is
compiled once before the runs (its compile time is reported apart). On a CPU the overlap loop runs the forward on a worker
thread (`--cpu-forward-stream thread`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import jsonschema  # noqa: E402
import torch  # noqa: E402

from radixengine.managers.io_struct import BatchTokenIDOut, TokenizedGenerateReqInput  # noqa: E402
from radixengine.managers.scheduler import Scheduler  # noqa: E402
from radixengine.managers.scheduler_io import InProcessIO  # noqa: E402
from radixengine.model_executor.tp_worker import TpModelWorker  # noqa: E402
from radixengine.model_loader import get_tokenizer  # noqa: E402
from radixengine.sampling.sampling_params import SamplingParams  # noqa: E402
from radixengine.server_args import ServerArgs  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 32},
        "email": {"type": "string", "pattern": "^[a-z]{3,12}@[a-z]{3,10}\\.(com|org)$"},
        "hobbies": {
            "type": "array",
            "items": {"type": "string", "maxLength": 20},
            "minItems": 1,
            "maxItems": 3,
        },
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "email", "hobbies", "employed"],
}
SUBJECTS = [
    "a teacher", "a pilot", "a baker", "a nurse", "a farmer", "a painter", "a chef", "a student",
    "a doctor", "a poet", "a sailor", "a judge", "a dancer", "a miner", "a writer", "a singer",
    "an actor", "an engineer", "an architect", "a plumber", "a gardener", "a librarian", "a boxer",
    "a surgeon", "a barber", "a tailor", "a jeweller", "a florist", "a potter", "a dentist",
    "a drummer", "a climber",
]  # fmt: skip


def chat_prompt(tokenizer, subject: str) -> list[int]:
    messages = [{"role": "user", "content": f"Invent {subject} and describe them as a JSON object."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


class Probe:
    """Host intervals of each batch's forward (on a CPU; a GPU forward is asynchronous) and of
    its mask filling: the mask time that ran while that batch's forward ran is hidden."""

    def __init__(self, worker: TpModelWorker) -> None:
        self.worker = worker
        self.cpu = not str(worker.device).startswith("cuda")
        self.forward: dict[int, tuple[float, float]] = {}
        self.mask: dict[int, tuple[float, float]] = {}

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def forward_batch_generation(self, mwb, **kwargs):
        start = time.perf_counter()
        out = self.worker.forward_batch_generation(mwb, **kwargs)
        self.forward[id(mwb)] = (start, time.perf_counter())
        return out

    def wrap_mask(self, sched: Scheduler) -> None:
        fill = sched.model_worker.update_vocab_mask

        def timed(batch, mwb):
            start = time.perf_counter()
            fill(batch, mwb)
            self.mask[id(mwb)] = (start, time.perf_counter())

        sched.model_worker.update_vocab_mask = timed

    def mean_forward_ms(self) -> float | None:
        if not self.cpu or not self.forward:
            return None
        return 1e3 * sum(e - s for s, e in self.forward.values()) / len(self.forward)

    def hidden_fraction(self) -> float | None:
        total = sum(e - s for s, e in self.mask.values())
        if not self.cpu or total == 0:
            return None
        hidden = 0.0
        for key, (ms, me) in self.mask.items():
            fs, fe = self.forward.get(key, (0.0, 0.0))
            hidden += max(0.0, min(me, fe) - max(ms, fs))
        return hidden / total


def make_scheduler(worker, tokenizer, model_args: dict, overlap: bool) -> Scheduler:
    req_pool, allocator = worker.get_memory_pool()
    req_pool.clear()
    allocator.clear()
    args = ServerArgs(**model_args, disable_overlap_schedule=not overlap, cpu_forward_stream="thread")
    return Scheduler(args, tp_worker=Probe(worker), tokenizer=tokenizer, io=InProcessIO())


def run(sched: Scheduler, reqs: list[TokenizedGenerateReqInput], cuda: bool) -> tuple[dict, float]:
    sched.flush_cache()
    sched.timer.reset()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    sched.io.put(*reqs)
    sched.run_until_idle(1_000_000)
    wall = time.perf_counter() - start
    outputs: dict[str, list[int]] = {}
    for msg in sched.io.take_outputs():
        if isinstance(msg, BatchTokenIDOut):
            for rid, ids in zip(msg.rids, msg.output_ids):
                outputs.setdefault(rid, []).extend(ids)
    return outputs, wall


def measure(sched, reqs, cuda: bool) -> tuple[dict, dict]:
    probe = sched.tp_worker
    probe.wrap_mask(sched)
    outputs, wall = run(sched, reqs, cuda)
    summary = sched.timer.summary()
    tokens = sum(len(v) for v in outputs.values())
    forward_steps = max(sched.stats.num_forward_steps, 1)  # every one of them fills masks
    grammar_s = summary["grammar_ms"] * summary["steps"] / 1e3
    row = {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "forward_steps": forward_steps,
        "step_ms": 1e3 * wall / forward_steps,
        "mask_ms_per_step": 1e3 * grammar_s / forward_steps,
        "mask_hidden_fraction": probe.hidden_fraction(),
        "forward_ms": probe.mean_forward_ms(),
    }
    return outputs, row


def valid(tokenizer, ids: list[int]) -> bool:
    try:
        jsonschema.validate(json.loads(tokenizer.decode(ids, skip_special_tokens=True)), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="default: the bundled SmolLM2 GGUF")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--grammar-backend", default="xgrammar")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2, help="runs per case; the fastest is reported")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    model_args = dict(
        model_path=args.model_path,
        device=args.device,
        dtype=args.dtype,
        grammar_backend=args.grammar_backend,
        chunked_prefill_size=-1,
        max_running_requests=args.num_requests,
    )
    if args.num_threads is not None:
        model_args["num_threads"] = args.num_threads
    tokenizer = get_tokenizer(args.model_path)
    worker = TpModelWorker(ServerArgs(**model_args))
    cuda = str(worker.device).startswith("cuda")
    subjects = (SUBJECTS * (args.num_requests // len(SUBJECTS) + 1))[: args.num_requests]
    prompts = [chat_prompt(tokenizer, s) for s in subjects]
    schema = json.dumps(SCHEMA)

    def constrained(tag: str) -> list[TokenizedGenerateReqInput]:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0, json_schema=schema)
        return [TokenizedGenerateReqInput(f"{tag}{i}", None, p, params) for i, p in enumerate(prompts)]

    def free(tag: str, lengths: dict[str, int]) -> list[TokenizedGenerateReqInput]:
        return [
            TokenizedGenerateReqInput(
                f"{tag}{i}",
                None,
                p,
                SamplingParams(max_new_tokens=lengths[f"c{i}"], temperature=0.0, ignore_eos=True),
            )
            for i, p in enumerate(prompts)
        ]

    warm = make_scheduler(worker, tokenizer, model_args, overlap=False)
    t0 = time.perf_counter()
    warm.grammar_manager.backend.get_future(("json_schema", schema)).result()
    compile_s = time.perf_counter() - t0
    warm.io.put(*constrained("warm")[:4])  # warm-up: allocator, kernels
    warm.run_until_idle(1_000_000)
    warm.io.take_outputs()
    warm.close()

    def one_run(loop: str, kind: str, lengths: dict[str, int]) -> tuple[dict, dict]:
        sched = make_scheduler(worker, tokenizer, model_args, overlap=loop == "overlap")
        sched.grammar_manager.backend = warm.grammar_manager.backend  # the compiled grammar, cached
        reqs = constrained("c") if kind == "constrained" else free("u", lengths)
        outputs, row = measure(sched, reqs, cuda)
        row["overlap_step_order"] = sched.enable_overlap
        sched.close()
        return outputs, row

    # The constrained outputs fix each request's length for the unconstrained twin.
    outputs, _ = one_run("normal", "constrained", {})
    lengths = {rid: len(ids) for rid, ids in outputs.items()}
    runs: dict[tuple[str, str], list[dict]] = {}
    invalid: dict[str, int] = {}
    order = [(loop, kind) for loop in ("normal", "overlap") for kind in ("constrained", "unconstrained")]
    for i in range(args.repeats):  # alternating, so that a load spike hits every case alike
        for loop, kind in order if i % 2 == 0 else order[::-1]:
            outputs, row = one_run(loop, kind, lengths)
            runs.setdefault((loop, kind), []).append(row)
            if kind == "constrained":
                invalid[loop] = invalid.get(loop, 0) + sum(
                    not valid(tokenizer, ids) for ids in outputs.values()
                )
    rows = {}
    for loop in ("normal", "overlap"):
        con, unc = (min(runs[(loop, k)], key=lambda r: r["wall_s"]) for k in ("constrained", "unconstrained"))
        rows[loop] = {
            "constrained": con,
            "unconstrained": unc,
            "walls_s": {k: [r["wall_s"] for r in runs[(loop, k)]] for k in ("constrained", "unconstrained")},
            "invalid": invalid[loop],
            "throughput_ratio": con["tokens_per_s"] / unc["tokens_per_s"],
            "extra_ms_per_step": con["step_ms"] - unc["step_ms"],
        }

    result = {
        "model": args.model_path or "SmolLM2-135M-Instruct (GGUF, default)",
        "device": str(worker.device),
        "grammar_backend": args.grammar_backend,
        "num_requests": args.num_requests,
        "compile_s": compile_s,
        "loadavg": os.getloadavg(),
        "loops": rows,
    }
    print(json.dumps(result, indent=2))
    print()
    print(
        "| loop | constrained tok/s | unconstrained tok/s | ratio | step ms c / u | mask ms/step | mask hidden | invalid |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for loop, r in rows.items():
        c, u = r["constrained"], r["unconstrained"]
        frac = c["mask_hidden_fraction"]
        hidden = "—" if frac is None else f"{100 * frac:.0f}%"
        print(
            f"| {loop} | {c['tokens_per_s']:.1f} | {u['tokens_per_s']:.1f} | {r['throughput_ratio']:.3f} | "
            f"{c['step_ms']:.1f} / {u['step_ms']:.1f} | {c['mask_ms_per_step']:.2f} | {hidden} | {r['invalid']} |"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
