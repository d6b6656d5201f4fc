"""Where one forward step of the default model goes on a CPU: wall time per part of the model,
for a decode step (batch B, every request with C cached tokens) and a prefill chunk.

    python benchmarks/profile_step.py                          # decode bs 32 x 512 cached, prefill 8 x 256
    python benchmarks/profile_step.py --quantization none      # float32 weights only
    RADIXENGINE_NATIVE_OPS=0 python benchmarks/profile_step.py --attention-backend torch_native
    python benchmarks/profile_step.py --dtype bfloat16 --cached-len 480 --shared-prefix-len 420  # W1's shape
    python benchmarks/profile_step.py --cached-len 480 --shared-prefix-len 420 --prefix-groups 4   # a tree
    python benchmarks/profile_step.py --shared-prefix-len 420 --disable-shared-prefix-attention    # ablation
    python benchmarks/profile_step.py --dtype bfloat16 --cached-len 480 --shared-prefix-len 420 --compare-own-only
    python benchmarks/profile_step.py --dtype bfloat16 --cached-len 480 --shared-prefix-len 420 --prefix-groups 4 \
        --lora-adapters 4 --lora-rank 8                                                      # W1 over 4 adapters

With --shared-prefix-len P the decode batch's requests share their first P KV slots (a radix-cache
hit), in --prefix-groups groups of requests (each group its own prefix); the rest of each
request's cached tokens are its own.

--compare-own-only alternates, in one process, decode steps of the shared-prefix batch with the
shared-prefix pass off, with it on, and of a batch whose requests hold only their own tokens (no
prefix at all: the work every shared-prefix pass still has, so its attention bounds what the pass
can reach), round after round, and reports each one's median step and attention time.

Each part is timed by wrapping the module's forward with perf_counter (the parts run one after
another on the calling thread, so the times add up; "other" is the rest of the step: embedding,
residual adds, activation, batch metadata, Python dispatch). The parts: linears by role (qkv, o,
gate_up, down), the LM head, attention (the backend call, KV write included), RMSNorm, rotary.
With --lora-adapters N (random PEFT adapters of --lora-rank, request i on adapter i mod N) the
adapters' deltas are a part of their own, "lora delta" (the base linears' parts leave it out).
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from bench_forward import OurModel, _fill_random_kv  # noqa: E402
from bench_lora import write_adapter  # noqa: E402

from radixengine.layers.layernorm import RMSNorm  # noqa: E402
from radixengine.layers.linear import Linear  # noqa: E402
from radixengine.layers.logits_processor import LogitsProcessor  # noqa: E402
from radixengine.layers.radix_attention import RadixAttention  # noqa: E402
from radixengine.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from radixengine.lora import lora_manager  # noqa: E402
from radixengine.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from radixengine.model_executor.model_runner import ModelRunner  # noqa: E402
from radixengine.server_args import ServerArgs  # noqa: E402

ROLES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class PartTimer:
    """Each part's own time: a part timed inside another (the LoRA delta inside its linear's
    forward) counts for itself, not for the one around it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._timed_total = 0.0  # the whole time of every timed call finished so far

    def timed(self, fn, part: str):
        def call(*args, **kwargs):
            inner_before = self._timed_total
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            elapsed = time.perf_counter() - start
            self.seconds[part] += elapsed - (self._timed_total - inner_before)
            self._timed_total = inner_before + elapsed
            return out

        return call

    def wrap(self, module: torch.nn.Module, part: str) -> None:
        module.forward = self.timed(module.forward, part)

    def instrument(self, model: torch.nn.Module) -> None:
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if isinstance(module, Linear) and leaf in ROLES:
                self.wrap(module, f"linear {leaf}")
            elif isinstance(module, LogitsProcessor):
                self.wrap(module, "lm_head + logits")
            elif isinstance(module, RadixAttention):
                self.wrap(module, "attention (+ KV write)")
            elif isinstance(module, RMSNorm):
                self.wrap(module, "rmsnorm")
            elif isinstance(module, RotaryEmbedding):
                self.wrap(module, "rotary")

    def instrument_lora_delta(self) -> None:
        """The adapters' deltas (in the base linears' forwards) as a part of their own."""
        lora_manager.apply_lora_delta = self.timed(lora_manager.apply_lora_delta, "lora delta")


class DecodeSteps:
    """`bs` requests with `cached` random K/V tokens each; every call times one more decode step."""

    def __init__(
        self,
        model: OurModel,
        bs: int,
        cached: int,
        timer: PartTimer,
        shared: int = 0,
        groups: int = 1,
        lora_ids: list[str | None] | None = None,
    ) -> None:
        runner = model.runner
        self.lora_ids = lora_ids
        self.model, self.timer, self.vocab = model, timer, runner.model_config.vocab_size
        self.pool, self.alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
        self.rows = self.pool.alloc(bs)
        prefixes = [self.alloc.alloc(shared) for _ in range(groups)] if shared else []
        slots = list(prefixes)
        for i, row in enumerate(self.rows):
            own = self.alloc.alloc(cached - shared)
            slots.append(own)
            row_slots = torch.cat((prefixes[i * groups // bs], own)) if shared else own
            self.pool.write((row, slice(0, cached)), row_slots.int())
        _fill_random_kv(runner, torch.cat(slots))
        self.seq = cached

    def __call__(self) -> float:
        locs = self.alloc.alloc(len(self.rows))
        for row, loc in zip(self.rows, locs):
            self.pool.write((row, self.seq), int(loc))
        self.seq += 1
        ids = torch.randint(self.vocab, (len(self.rows),))
        self.timer.seconds.clear()
        start = time.perf_counter()
        self.model._forward(
            ForwardMode.DECODE, ids, self.rows, [self.seq] * len(self.rows), locs, lora_ids=self.lora_ids
        )
        return time.perf_counter() - start


def prefill_step(
    model: OurModel, num_reqs: int, length: int, lora_ids: list[str | None] | None = None
) -> float:
    """One EXTEND of `num_reqs` new prompts of `length` tokens (no cached prefix)."""
    runner = model.runner
    rows = runner.req_to_token_pool.alloc(num_reqs)
    slots = [runner.token_to_kv_pool_allocator.alloc(length) for _ in rows]
    for row, locs in zip(rows, slots):
        runner.req_to_token_pool.write((row, slice(0, length)), locs.int())
    ids = torch.randint(runner.model_config.vocab_size, (num_reqs * length,))
    n = len(rows)
    start = time.perf_counter()
    model._forward(
        ForwardMode.EXTEND,
        ids,
        rows,
        [length] * n,
        torch.cat(slots),
        [0] * n,
        [length] * n,
        lora_ids=lora_ids,
    )
    elapsed = time.perf_counter() - start
    model._release(rows, slots)
    return elapsed


def compare_own_only(model: OurModel, args, timer: PartTimer) -> dict:
    """Steps of the shared-prefix batch with the pass off and on, and of the own-tokens-only batch,
    alternated for `args.repeats` rounds of 3 steps each; medians per configuration."""
    own = args.cached_len - args.shared_prefix_len
    shared = DecodeSteps(
        model, args.batch_size, args.cached_len, timer, args.shared_prefix_len, args.prefix_groups
    )
    own_only = DecodeSteps(model, args.batch_size, own, timer)
    backend = model.runner.attn_backend
    min_len = backend.shared_prefix_min_len
    configs = {"pass off": (shared, None), "pass on": (shared, min_len), "own tokens only": (own_only, None)}
    samples: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in configs}
    for _ in range(args.repeats + 1):
        for name, (steps, length) in configs.items():
            backend.shared_prefix_min_len = length
            for _ in range(3):
                total = steps()
                samples[name]["step_ms"].append(total * 1e3)
                samples[name]["attention_ms"].append(timer.seconds["attention (+ KV write)"] * 1e3)
    backend.shared_prefix_min_len = min_len
    # the first round warms up
    return {name: {k: statistics.median(v[3:]) for k, v in s.items()} for name, s in samples.items()}


def breakdown(run, timer: PartTimer, repeats: int) -> dict:
    totals, parts = [], defaultdict(list)
    for _ in range(repeats + 1):
        timer.seconds.clear()
        total = run()
        totals.append(total)
        for part, sec in timer.seconds.items():
            parts[part].append(sec)
        parts["other"].append(total - sum(timer.seconds.values()))
    # the first run warms up
    return {
        "step_ms": statistics.median(totals[1:]) * 1e3,
        "parts_ms": {
            p: statistics.median(v[1:]) * 1e3 for p, v in sorted(parts.items(), key=lambda kv: -sum(kv[1]))
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None)
    p.add_argument("--dtype", default="float32", help="the model's dtype (float32, bfloat16)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--cached-len", type=int, default=512)
    p.add_argument("--shared-prefix-len", type=int, default=0, help="KV slots shared by the decode batch")
    p.add_argument("--prefix-groups", type=int, default=1, help="groups of requests, each its own prefix")
    p.add_argument("--disable-shared-prefix-attention", action="store_true")
    p.add_argument("--prefill-reqs", type=int, default=8)
    p.add_argument("--prefill-len", type=int, default=256, help="tokens per prefill request")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compare-own-only", action="store_true", help="see above; needs --shared-prefix-len")
    p.add_argument(
        "--lora-adapters", type=int, default=0, help="random adapters, request i on adapter i mod N"
    )
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.compare_own_only and (not args.shared_prefix_len or args.disable_shared_prefix_attention):
        p.error("--compare-own-only needs --shared-prefix-len and the shared-prefix pass on")
    if args.compare_own_only and args.lora_adapters:
        p.error("--compare-own-only runs the base model only: leave out --lora-adapters")

    model = OurModel.__new__(OurModel)
    batches = 2 if args.compare_own_only else 1  # the own-tokens-only batch beside the shared one
    steps = 8 + 3 * (args.repeats + 1) if args.compare_own_only else 8
    tokens = batches * args.batch_size * (args.cached_len + steps) + args.prefill_reqs * args.prefill_len + 64
    if not 0 <= args.shared_prefix_len < args.cached_len or not 1 <= args.prefix_groups <= args.batch_size:
        p.error("need 0 <= --shared-prefix-len < --cached-len and 1 <= --prefix-groups <= --batch-size")
    model.runner = ModelRunner(
        ServerArgs(
            model_path=args.model_path,
            dtype=args.dtype,
            max_total_tokens=tokens,
            max_running_requests=batches * args.batch_size + args.prefill_reqs + 1,
            attention_backend=args.attention_backend,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            num_threads=args.threads,
            disable_shared_prefix_attention=args.disable_shared_prefix_attention,
            **lora_flags(args),
        )
    )
    timer = PartTimer()
    timer.instrument(model.runner.model)
    timer.instrument_lora_delta()
    decode_loras = lora_ids(model.runner, args.batch_size)
    if args.compare_own_only:
        report_own_only(compare_own_only(model, args, timer), args)
        return
    results = {
        "config": vars(args),
        "threads": torch.get_num_threads(),
        "attention_backend": type(model.runner.attn_backend).__name__,
        "decode": breakdown(
            DecodeSteps(
                model,
                args.batch_size,
                args.cached_len,
                timer,
                args.shared_prefix_len,
                args.prefix_groups,
                decode_loras,
            ),
            timer,
            args.repeats,
        ),
    }
    if args.prefill_reqs > 0:
        results["prefill"] = breakdown(
            lambda: prefill_step(
                model, args.prefill_reqs, args.prefill_len, lora_ids(model.runner, args.prefill_reqs)
            ),
            timer,
            args.repeats,
        )
    for case in [c for c in ("decode", "prefill") if c in results]:
        r = results[case]
        label = (
            f"decode bs {args.batch_size} x {args.cached_len} cached"
            + (
                f" ({args.shared_prefix_len} shared, {args.prefix_groups} groups)"
                if args.shared_prefix_len
                else ""
            )
            if case == "decode"
            else f"prefill {args.prefill_reqs} x {args.prefill_len} tokens"
        )
        print(
            f"{label}: {r['step_ms']:.1f} ms ({args.dtype}, {results['attention_backend']}, quantization {args.quantization}, "
            f"KV cache {args.kv_cache_dtype})"
        )
        for part, ms in r["parts_ms"].items():
            print(f"  {part:<24} {ms:8.1f} ms  {100 * ms / r['step_ms']:5.1f}%")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))


def lora_flags(args) -> dict:
    """The server flags of `--lora-adapters` random adapters (written to a temporary folder)."""
    if not args.lora_adapters:
        return {}
    from radixengine.model_loader import ModelConfig, default_model_path

    config = ModelConfig(args.model_path or default_model_path(), None, args.dtype, "cpu").hf_config
    folder = Path(tempfile.mkdtemp(prefix="profile-step-lora-"))
    atexit.register(shutil.rmtree, folder, True)
    paths = [
        f"lora{i}=" + write_adapter(folder / f"a{i}", config, args.lora_rank, seed=i)
        for i in range(args.lora_adapters)
    ]
    return {"lora_paths": paths, "max_loras_per_batch": max(8, args.lora_adapters)}


def lora_ids(runner: ModelRunner, num_reqs: int) -> list[str | None] | None:
    """Request i's adapter: the loaded adapter i mod N (by the worker's ids, in load order)."""
    if runner.lora_manager is None:
        return None
    loaded = list(runner.lora_manager.adapters)
    return [loaded[i % len(loaded)] for i in range(num_reqs)]


def report_own_only(medians: dict, args) -> None:
    off, on, floor = (medians[name] for name in ("pass off", "pass on", "own tokens only"))
    print(f"decode bs {args.batch_size} x {args.cached_len} cached ({args.shared_prefix_len} shared, "
          f"{args.prefix_groups} groups), {args.dtype}, medians of {args.repeats} rounds x 3 steps:")  # fmt: skip
    print("| configuration | step ms | attention (+ KV write) ms |")
    print("| --- | ---: | ---: |")
    for name, m in medians.items():
        print(f"| {name} | {m['step_ms']:.1f} | {m['attention_ms']:.1f} |")
    print(f"attention off / on {off['attention_ms'] / on['attention_ms']:.2f}x, step {off['step_ms'] / on['step_ms']:.2f}x; "
          f"bound (off / own tokens only): attention {off['attention_ms'] / floor['attention_ms']:.2f}x, "
          f"step {off['step_ms'] / floor['step_ms']:.2f}x")  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(
                {"config": vars(args), "threads": torch.get_num_threads(), "medians": medians}, indent=2
            )
        )


if __name__ == "__main__":
    main()
