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
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    load_before = os.getloadavg()
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
    if args.out:
        meta = {
            "command": " ".join(sys.argv),
            "cpu": _cpu_name(),
            "threads": args.threads,
            "time": time.ctime(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "cached_len": args.cached_len,
            "torch": torch.__version__,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
