"""Decode-step time on a GPU: attention backends and CUDA graphs on/off, random weights from a
model config (no checkpoint needed). One step = ForwardBatch from host tensors, forward, greedy
argmax, synchronize (what the scheduler waits for each step).

    python benchmarks/bench_gpu_decode.py --configs smollm2,llama-1b --out decode.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_shapes import write_shape_folder  # noqa: E402

from radixengine.model_executor.forward_batch_info import (  # noqa: E402
    ForwardBatch,
    ForwardMode,
    ModelWorkerBatch,
)
from radixengine.model_executor.model_runner import ModelRunner  # noqa: E402
from radixengine.server_args import ServerArgs  # noqa: E402

VARIANTS = {  # name -> (attention backend, CUDA graphs)
    "torch_native": ("torch_native", False),
    "triton": ("triton", False),
    "triton+graph": ("triton", True),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="smollm2,llama-1b", help="shapes of benchmarks/model_shapes.py")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--cached-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    p.add_argument("--out", default=None)
    return p.parse_args()


def make_runner(path: str, variant: str, args, max_bs: int) -> ModelRunner:
    backend, graphs = VARIANTS[variant]
    tokens = max_bs * (args.cached_len + args.steps + 8) + 64
    return ModelRunner(
        ServerArgs(
            model_path=path,
            device=args.device,
            dtype=args.dtype,
            load_format="dummy",
            max_total_tokens=tokens,
            max_running_requests=max_bs,
            attention_backend=backend,
            disable_cuda_graph=not graphs,
            cuda_graph_max_bs=max_bs,
        )
    )


def decode_steps(runner: ModelRunner, bs: int, args) -> list[float]:
    """Per-step seconds of `args.steps` decode steps (after 3 warm-up steps) for `bs` requests
    with `cached_len` tokens each already in the pool."""
    span = args.cached_len + args.steps + 8
    rows = torch.arange(bs, dtype=torch.int64)
    table = runner.req_to_token_pool.req_to_token
    for i in range(bs):  # request i owns slots 1 + i * span ...
        table[i, :span] = torch.arange(1 + i * span, 1 + (i + 1) * span, dtype=torch.int32)
    ids = torch.zeros(bs, dtype=torch.int64)
    times = []
    for step in range(3 + args.steps):
        seq_len = args.cached_len + step + 1
        batch = ModelWorkerBatch(
            forward_mode=ForwardMode.DECODE,
            input_ids=ids,
            req_pool_indices=rows,
            seq_lens=torch.full((bs,), seq_len, dtype=torch.int64),
            seq_lens_cpu=[seq_len] * bs,
            out_cache_loc=rows * span + seq_len,  # slot 1 + i * span + (seq_len - 1)
            extend_prefix_lens=None,
            extend_seq_lens=None,
            sampling_info=None,
        )
        _sync(args.device)
        start = time.perf_counter()
        fb = ForwardBatch.init_new(batch, runner)
        out = runner.forward(fb)
        ids = torch.argmax(out.next_token_logits, dim=-1).cpu()
        if step >= 3:
            times.append(time.perf_counter() - start)
    return times


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    args = parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs.split(","):
            path = write_shape_folder(name, Path(tmp))
            for variant in args.variants.split(","):
                runner = make_runner(path, variant, args, max(sizes))
                for bs in sizes:
                    t = statistics.median(decode_steps(runner, bs, args))
                    row = dict(model=name, variant=variant, batch_size=bs, step_ms=round(t * 1e3, 3))
                    row["tokens_per_s"] = round(bs / t, 1)
                    results.append(row)
                    print(json.dumps(row), flush=True)
                del runner
                if args.device == "cuda":
                    torch.cuda.empty_cache()
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\n{device}, torch {torch.__version__}, dtype {args.dtype}, cached_len {args.cached_len}")
    print("| model | variant | " + " | ".join(f"bs {b} ms" for b in sizes) + " |")
    print("|---|---|" + "---:|" * len(sizes))
    for name in args.configs.split(","):
        for variant in args.variants.split(","):
            cells = [r["step_ms"] for r in results if r["model"] == name and r["variant"] == variant]
            print(f"| {name} | {variant} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=device, results=results), indent=1))


if __name__ == "__main__":
    main()
