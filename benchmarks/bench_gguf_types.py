"""Decode steps of the default model (SmolLM2-135M GGUF) re-quantized into each GGUF block type,
through the block kernels (`--quantization gguf`), against float32 weights (`--quantization none`).

Each type's file is the bundled GGUF's tensors dequantized and quantized again (gguf-py's
quantizer; the K-quants by `tests/gguf_utils.quantize_k`, which gguf-py cannot write). As
llama.cpp does, a matrix whose rows are not a whole number of 256-weight super-blocks (SmolLM2's
hidden size is 576) takes the type's 32-weight substitute: Q4_K -> Q5_0, Q5_K -> Q5_1,
Q6_K -> Q8_0. `Q4_K_M` is llama.cpp's mix: Q6_K for the embedding/output and for attn_v and
ffn_down in the first and last eighth of the layers and every third between, Q4_K elsewhere.

    python benchmarks/bench_gguf_types.py --out bench_results/gguf_types.json
    python benchmarks/bench_gguf_types.py --types Q4_1,Q4_K_M --write-only   # just the files

Types and the float run alternate round by round (load from other processes falls on all alike);
times are the median over rounds of each round's median step, in ms.

One weight (always): `quant_linear` at M = 1 on one 2048 x 2048 weight of each type, 1 thread,
the weight warm in cache: the dequantization's instruction cost alone (the minimum over rounds
of 30 calls' median; the least disturbed by other processes).

Kernel pass (`--kernel-layers N`, 0 skips it): SmolLM2's rows of 576 weights leave the K-quants
only ffn_down, so the kernels alone are also timed at M = 1 (one decode token) over N layers of a
Llama-3.2-1B shape (qkv 3072x2048, o 2048x2048, gate_up 16384x2048, down 2048x8192; random
blocks with sane scales, which stream from memory as in a real step), every linear in one type,
or mixed as llama.cpp's Q4_K_M (Q6_K v and down in the layers `_use_more_bits` picks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

from bench_forward import OurModel, _cpu_name  # noqa: E402
from gguf_utils import quantize  # noqa: E402

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M")
K_SUBSTITUTE = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
QK_K = 256


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--dir", default=str(REPO / "bench_results" / "gguf_types"), help="where the files go")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--cached-len", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=8, help="timed decode steps per round")
    p.add_argument("--repeats", type=int, default=5, help="rounds")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kernel-layers", type=int, default=8, help="layers of the kernel pass (0: none)")
    p.add_argument("--single-only", action="store_true", help="only the one-weight kernel timing")
    p.add_argument("--write-only", action="store_true")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args()


def _use_more_bits(layer: int, layers: int) -> bool:
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def target_type(recipe: str, name: str, layers: int, cols: int) -> str:
    """The type llama.cpp gives tensor `name` (cols weights a row) under `recipe`."""
    if recipe == "Q4_K_M":
        kind = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
        if kind in ("token_embd", "output"):
            qtype = "Q6_K"
        elif kind in ("attn_v", "ffn_down") and _use_more_bits(int(name.split(".")[1]), layers):
            qtype = "Q6_K"
        else:
            qtype = "Q4_K"
    else:
        qtype = recipe
    return K_SUBSTITUTE[qtype] if qtype in K_SUBSTITUTE and cols % QK_K else qtype


def requantize(src: str, dst: Path, recipe: str) -> Path:
    """`src` with every matrix dequantized and quantized again under `recipe`; metadata copied."""
    import gguf

    if dst.exists():
        return dst
    reader = gguf.GGUFReader(src)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    layers = int(reader.fields[f"{arch}.block_count"].contents())
    tmp = dst.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        shape = tuple(reversed([int(d) for d in t.shape]))
        if len(shape) != 2:
            writer.add_tensor(t.name, np.array(t.data), raw_shape=t.data.shape, raw_dtype=t.tensor_type)
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        qtype = gguf.GGMLQuantizationType[target_type(recipe, t.name, layers, shape[1])]
        q = quantize(np.ascontiguousarray(w), qtype)
        writer.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    return dst


def type_counts(path: Path) -> dict[str, int]:
    import gguf

    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        if len(t.shape) == 2:
            name = gguf.GGMLQuantizationType(t.tensor_type).name
            counts[name] = counts.get(name, 0) + 1
    return counts


KERNEL_SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
# Byte offsets of each block type's fp16 scales (d, and m / dmin where it has one).
SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,)}
SCALE_OFFSETS |= {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(n: int, k: int, name: str, gen: torch.Generator) -> torch.Tensor:
    from radixengine.layers import gguf_quant_ops as gq

    qtype = gq.GGML_TYPES[name]
    nblocks, size = k // gq.BLOCK_WEIGHTS[qtype], gq.BLOCK_BYTES[qtype]
    blocks = torch.randint(0, 256, (n, nblocks, size), dtype=torch.uint8, generator=gen)
    for offset in SCALE_OFFSETS[name]:
        scales = (torch.rand(n, nblocks, generator=gen) * 0.01).half().view(torch.uint8)
        blocks[..., offset : offset + 2] = scales.reshape(n, nblocks, 2)
    return blocks.reshape(n, -1).contiguous()


def kernel_layers(recipe: str, num_layers: int) -> list[tuple[torch.Tensor, int]]:
    from radixengine.layers import gguf_quant_ops as gq

    gen = torch.Generator().manual_seed(0)
    weights = []
    for layer in range(num_layers):
        for part, (n, k) in KERNEL_SHAPES.items():
            name = recipe
            if recipe == "Q4_K_M":
                name = "Q6_K" if part == "down" and _use_more_bits(layer, num_layers) else "Q4_K"
            if recipe == "Q4_K_M" and part == "qkv" and _use_more_bits(layer, num_layers):
                q, v = random_blocks(n - 512, k, "Q4_K", gen), random_blocks(512, k, "Q6_K", gen)
                weights += [(q, gq.GGML_Q4_K), (v, gq.GGML_Q6_K)]  # the fused qkv's two parts
                continue
            weights.append((random_blocks(n, k, name, gen), gq.GGML_TYPES[name]))
    return weights


def bench_single(types: list[str], repeats: int) -> list[dict]:
    from radixengine.layers import gguf_quant_ops as gq

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    names = [t for t in types if t in gq.GGML_TYPES]
    weights = {t: random_blocks(2048, 2048, t, gen) for t in names}
    x = torch.randn(1, 2048)
    times: dict[str, list[float]] = {t: [] for t in names}
    for _ in range(repeats):
        for t, q in weights.items():
            qtype = gq.GGML_TYPES[t]
            gq.quant_linear(x, q, qtype)
            calls = []
            for _ in range(30):
                start = time.perf_counter()
                gq.quant_linear(x, q, qtype)
                calls.append((time.perf_counter() - start) * 1e3)
            times[t].append(statistics.median(calls))
    rows = [{"weights": t, "ms": min(v), "median_ms": statistics.median(v)} for t, v in times.items()]
    print("\none 2048 x 2048 weight, M = 1, 1 thread, in cache")
    for r in rows:
        print(f"{r['weights']:<10} {r['ms']:>8.3f} ms")
    return rows


def bench_kernels(types: list[str], num_layers: int, repeats: int, threads: int) -> list[dict]:
    from radixengine.layers import gguf_quant_ops as gq

    torch.set_num_threads(threads)
    passes = {t: kernel_layers(t, num_layers) for t in types}
    xs = {k: torch.randn(1, k) for k in (2048, 8192)}
    times: dict[str, list[float]] = {t: [] for t in types}
    for _ in range(repeats):
        for t, weights in passes.items():
            start = time.perf_counter()
            for q, qtype in weights:
                gq.quant_linear(xs[q.shape[1] // gq.BLOCK_BYTES[qtype] * gq.BLOCK_WEIGHTS[qtype]], q, qtype)
            times[t].append((time.perf_counter() - start) * 1e3)
    rows = []
    for t in types:
        nbytes = sum(q.numel() for q, _ in passes[t])
        ms = statistics.median(times[t])
        rows.append(
            {
                "weights": t,
                "pass_ms": ms,
                "min_ms": min(times[t]),
                "MB": nbytes / 1e6,
                "GB_s": nbytes / ms / 1e6,
            }
        )
    print(f"\nkernel pass, M = 1, {num_layers} Llama-3.2-1B layers")
    print(f"{'weights':<10} {'ms':>8} {'MB':>8} {'GB/s':>6}")
    for r in rows:
        print(f"{r['weights']:<10} {r['pass_ms']:>8.2f} {r['MB']:>8.1f} {r['GB_s']:>6.1f}")
    return rows


def main() -> None:
    args = parse_args()
    from radixengine.model_loader import default_model_path

    src = default_model_path()
    out_dir = Path(args.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"original": Path(src)}
    for recipe in [t for t in args.types.split(",") if t]:
        files[recipe] = requantize(src, out_dir / f"smollm2-135m-{recipe}.gguf", recipe)
        print(f"{recipe}: {files[recipe]} {type_counts(files[recipe])}", file=sys.stderr)
    if args.write_only:
        return
    load_before = os.getloadavg()
    single_rows = bench_single([t for t in args.types.split(",") if t], max(args.repeats, 3))
    if args.single_only:
        _write(args, {"load_average_before": load_before}, {"single_rows": single_rows})
        return
    kernel_rows = []
    if args.kernel_layers:
        kernel_types = [t for t in args.types.split(",") if t]
        kernel_rows = bench_kernels(kernel_types, args.kernel_layers, args.repeats, args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    models = {}
    runs = [("float32", "original", "none")] + [(name, name, "gguf") for name in files]
    for label, name, quantization in runs:
        ns = argparse.Namespace(
            model_path=str(files[name]),
            prefill_len=16,
            cached_len=args.cached_len,
            decode_steps=args.decode_steps,
            attention_backend="torch_native",
            threads=args.threads,
            load_format="auto",
            kv_cache_dtype="auto",
            quantization=quantization,
        )
        models[label] = OurModel(ns, "float32", max(batch_sizes))
    vocab = 49152
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):
        for bs in batch_sizes:
            for label, model in models.items():
                steps = model.decode(bs, args.cached_len, args.decode_steps, vocab)
                times.setdefault((label, bs), []).append(statistics.median(steps) * 1e3)
    rows = []
    for (label, bs), ms in times.items():
        float_ms = statistics.median(times[("float32", bs)])
        median = statistics.median(ms)
        counts = type_counts(files[label]) if label in files else {}
        rows.append(
            {
                "weights": label,
                "batch": bs,
                "decode_ms": median,
                "min_ms": min(ms),
                "speedup_vs_float32": float_ms / median,
                "tensor_types": counts,
            }
        )
    rows.sort(key=lambda r: (r["batch"], r["weights"] != "float32", r["weights"]))
    print(f"{'weights':<10} {'batch':>5} {'decode ms':>10} {'vs fp32':>8}  tensor types")
    for r in rows:
        types = ", ".join(f"{k} {v}" for k, v in r["tensor_types"].items())
        print(
            f"{r['weights']:<10} {r['batch']:>5} {r['decode_ms']:>10.2f} {r['speedup_vs_float32']:>8.2f}  {types}"
        )
    meta = {"load_average_before": load_before, "cached_len": args.cached_len}
    _write(args, meta, {"rows": rows, "kernel_rows": kernel_rows, "single_rows": single_rows})


def _write(args: argparse.Namespace, meta: dict, results: dict) -> None:
    if args.out:
        meta = {
            "command": " ".join(sys.argv),
            "cpu": _cpu_name(),
            "threads": args.threads,
            "time": time.ctime(),
            "load_average_after": os.getloadavg(),
            "torch": torch.__version__,
            **meta,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, **results}, indent=2))


if __name__ == "__main__":
    main()
