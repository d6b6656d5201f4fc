"""Forward-pass benchmark: our ModelRunner vs transformers on the same weights, dtype, threads
and inputs, in one run. Prefill of one prompt, and decode steps at several batch sizes with a
cached context per request (filled with random K/V: the attention cost does not depend on it).

    python benchmarks/bench_forward.py --out bench_forward.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixengine.model_executor.forward_batch_info import (  # noqa: E402
    ForwardBatch,
    ForwardMode,
    ModelWorkerBatch,
)
from radixengine.model_executor.model_runner import ModelRunner  # noqa: E402
from radixengine.model_loader import resolve_model_path  # noqa: E402
from radixengine.server_args import ServerArgs  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--cached-len", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=4, help="timed decode steps per round")
    p.add_argument("--repeats", type=int, default=3, help="rounds, alternating ours and transformers")
    p.add_argument("--threads", type=int, default=None, help="default: torch's default")
    p.add_argument("--attention-backend", default="torch_native")
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: random weights from the config (same timing; for machines without the weights)",
    )
    p.add_argument("--kv-cache-dtype", default="auto", help="ours: the engine's --kv-cache-dtype")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args()


# Ours ------------------------------------------------------------------------------------------


class OurModel:
    def __init__(self, args: argparse.Namespace, dtype: str, max_bs: int) -> None:
        tokens = max_bs * (args.cached_len + args.decode_steps + 2) + args.prefill_len + 64
        self.runner = ModelRunner(
            ServerArgs(
                model_path=args.model_path,
                dtype=dtype,
                max_total_tokens=tokens,
                max_running_requests=max_bs + 1,
                attention_backend=args.attention_backend,
                num_threads=args.threads,
                load_format=args.load_format,
                kv_cache_dtype=args.kv_cache_dtype,
                quantization=getattr(args, "quantization", "auto"),
            )
        )

    def _forward(
        self, mode, ids, rows, seq_lens, locs, prefix=None, extend=None, lora_ids=None
    ) -> torch.Tensor:
        batch = ModelWorkerBatch(
            forward_mode=mode,
            input_ids=ids,
            req_pool_indices=torch.tensor(rows),
            seq_lens=torch.tensor(seq_lens),
            seq_lens_cpu=seq_lens,
            out_cache_loc=locs,
            extend_prefix_lens=prefix,
            extend_seq_lens=extend,
            sampling_info=None,
            lora_ids=lora_ids,
        )
        return self.runner.forward(ForwardBatch.init_new(batch, self.runner)).next_token_logits

    def prefill(self, ids: torch.Tensor) -> float:
        n = ids.numel()
        (row,) = self.runner.req_to_token_pool.alloc(1)
        locs = self.runner.token_to_kv_pool_allocator.alloc(n)
        self.runner.req_to_token_pool.write((row, slice(0, n)), locs.int())
        start = time.perf_counter()
        self._forward(ForwardMode.EXTEND, ids, [row], [n], locs, [0], [n])
        elapsed = time.perf_counter() - start
        self._release([row], [locs])
        return elapsed

    def decode(self, bs: int, cached: int, steps: int, vocab: int) -> list[float]:
        pool, alloc = self.runner.req_to_token_pool, self.runner.token_to_kv_pool_allocator
        rows, slots = pool.alloc(bs), []
        for row in rows:
            slots.append(alloc.alloc(cached))
            pool.write((row, slice(0, cached)), slots[-1].int())
        _fill_random_kv(self.runner, torch.cat(slots))
        times, seq = [], cached
        for _ in range(steps + 1):  # the first step warms up
            locs = alloc.alloc(bs)
            for row, loc in zip(rows, locs):
                pool.write((row, seq), int(loc))
            slots.append(locs)
            seq += 1
            ids = torch.randint(vocab, (bs,))
            start = time.perf_counter()
            self._forward(ForwardMode.DECODE, ids, rows, [seq] * bs, locs)
            times.append(time.perf_counter() - start)
        self._release(rows, slots)
        return times[1:]

    def _release(self, rows: list[int], slots: list[torch.Tensor]) -> None:
        self.runner.token_to_kv_pool_allocator.free(torch.cat(slots))
        self.runner.req_to_token_pool.free(rows)


def _fill_random_kv(runner: ModelRunner, locs: torch.Tensor) -> None:
    pool = runner.token_to_kv_pool
    for layer in range(runner.model_config.num_hidden_layers):
        for buf in pool.get_kv_buffer(layer):
            buf[locs] = torch.randn(len(locs), *buf.shape[1:], dtype=buf.dtype)


# transformers --------------------------------------------------------------------------------


class HFModel:
    def __init__(self, folder: str, dtype: torch.dtype, dummy: bool = False) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        if dummy:
            config = AutoConfig.from_pretrained(folder)
            self.model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        else:
            self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
        self.model.eval()
        self.dtype = dtype

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> float:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        start = time.perf_counter()
        self.model(ids.view(1, -1), past_key_values=cache, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start

    @torch.no_grad()
    def decode(self, bs: int, cached: int, steps: int, vocab: int) -> list[float]:
        cache = self._random_cache(bs, cached)
        times = []
        for step in range(steps + 1):
            ids = torch.randint(vocab, (bs, 1))
            positions = torch.full((bs, 1), cached + step)
            start = time.perf_counter()
            self.model(ids, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - start)
        return times[1:]

    def _random_cache(self, bs: int, cached: int):
        from transformers import DynamicCache

        c = self.model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        shape = (bs, c.num_key_value_heads, cached, head_dim)
        cache = DynamicCache(config=c)
        for layer in range(c.num_hidden_layers):
            cache.update(torch.randn(shape, dtype=self.dtype), torch.randn(shape, dtype=self.dtype), layer)
        return cache


# Driver ----------------------------------------------------------------------------------------


def run_dtype(args: argparse.Namespace, dtype: str, folder: str) -> list[dict]:
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    ours = OurModel(args, dtype, max(batch_sizes))
    hf = HFModel(folder, ours.runner.dtype, dummy=args.load_format == "dummy")
    vocab = ours.runner.model_config.vocab_size
    ids = torch.randint(vocab, (args.prefill_len,))
    rows = []
    ours.prefill(ids), hf.prefill(ids)  # warm-up
    ours_t, hf_t = [], []
    for _ in range(args.repeats):
        ours_t.append(ours.prefill(ids))
        hf_t.append(hf.prefill(ids))
    rows.append(_row(dtype, f"prefill {args.prefill_len}", ours_t, hf_t))
    for bs in batch_sizes:
        ours_t, hf_t = [], []
        for _ in range(args.repeats):
            ours_t += ours.decode(bs, args.cached_len, args.decode_steps, vocab)
            hf_t += hf.decode(bs, args.cached_len, args.decode_steps, vocab)
        rows.append(_row(dtype, f"decode bs={bs} ctx={args.cached_len}", ours_t, hf_t))
    return rows


def _row(dtype: str, case: str, ours: list[float], hf: list[float]) -> dict:
    """Medians and minima (the minimum is the steadier figure on a shared machine)."""
    o, h = statistics.median(ours), statistics.median(hf)
    o_min, h_min = min(ours), min(hf)
    row = {
        "dtype": dtype,
        "case": case,
        "ours_s": o,
        "transformers_s": h,
        "ratio": o / h,
        "ours_min_s": o_min,
        "transformers_min_s": h_min,
        "ratio_min": o_min / h_min,
    }
    print(
        f"{dtype:9s} {case:24s} ours {o * 1e3:8.1f} ms   transformers {h * 1e3:8.1f} ms   ratio {o / h:5.2f}"
        f"   (min {o_min * 1e3:8.1f} / {h_min * 1e3:8.1f} = {o_min / h_min:5.2f})"
    )
    return row


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    folder = resolve_model_path(args.model_path)
    rows = []
    for dtype in args.dtypes.split(","):
        rows += run_dtype(args, dtype, folder)
    result = {
        "machine": _cpu_name(),
        "transformers": _transformers_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "args": vars(args),
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
