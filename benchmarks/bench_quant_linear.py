"""GGUF block-quantized linear (native `quant_linear`) vs F.linear on the dequantized fp32 weight.

SmolLM2-135M's linears: qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536 (Q4_1) and the
tied lm_head 49152x576 (Q8_0), with the real blocks of the bundled GGUF when it is installed
(random blocks otherwise), at M = 1, 8, 32, 64, 128, 256 rows of x.

  single   one shape, the same weight every call (warm in cache for the small shapes)
  layers   a decode pass: for each of 30 layers its own qkv, o, gate_up and down weights, then
           the lm_head, so the weights stream from memory as in a real forward step

Native and F.linear calls alternate, round by round, so that load from other processes falls on
both alike; times are the median (and, in the JSON, the minimum) over rounds, in ms, and
GFLOP/s = 2 M N K / median. `crossover` is the smallest M at which F.linear's median is lower on
the 30-layer pass (the caller switches to F.linear from there).

    .venv/bin/python benchmarks/bench_quant_linear.py --out bench_results/quant_linear.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from radixengine.layers import gguf_quant_ops as gq
from radixengine.layers.attention import native_cpu_ops

NUM_LAYERS = 30
HIDDEN = 576
VOCAB = 49152
LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
GGUF_PARTS = {
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "o": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"),
    "down": ("ffn_down",),
}


@dataclass
class Weight:
    name: str
    qweight: torch.Tensor  # raw blocks
    qtype: int
    dense: torch.Tensor  # dequantized fp32 [N, K]


@dataclass
class Row:
    case: str
    m: int
    n: int
    k: int
    qtype: str
    native_ms: float  # median
    torch_ms: float
    native_min_ms: float
    torch_min_ms: float
    native_gflops: float
    torch_gflops: float
    speedup: float  # torch / native


def random_blocks(n: int, k: int, qtype: int, gen: torch.Generator) -> torch.Tensor:
    blocks = torch.randint(0, 256, (n, k // gq.QK, gq.BLOCK_BYTES[qtype]), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // gq.QK, generator=gen) * 0.02).half().view(torch.uint8)
    blocks[..., 0:2] = scales.reshape(n, -1, 2)
    if qtype == gq.GGML_Q4_1:
        mins = (-torch.rand(n, k // gq.QK, generator=gen) * 0.1).half().view(torch.uint8)
        blocks[..., 2:4] = mins.reshape(n, -1, 2)
    return blocks.reshape(n, -1).contiguous()


def make_weight(name: str, qweight: torch.Tensor, qtype: int) -> Weight:
    return Weight(name, qweight, qtype, gq.dequantize_reference(qweight, qtype))


def load_gguf_weights() -> tuple[list[dict[str, Weight]], Weight] | None:
    try:
        import gguf

        from radixengine.model_loader.default_model import default_model_path

        reader = gguf.GGUFReader(default_model_path())
    except (ImportError, FileNotFoundError):
        return None
    tensors = {t.name: t for t in reader.tensors}
    layers = []
    for layer in range(NUM_LAYERS):
        weights = {}
        for name, parts in GGUF_PARTS.items():
            blocks = [torch.from_numpy(tensors[f"blk.{layer}.{part}.weight"].data.copy()) for part in parts]
            weights[name] = make_weight(
                name, torch.cat(blocks), int(tensors[f"blk.{layer}.{parts[0]}.weight"].tensor_type)
            )
        layers.append(weights)
    embd = tensors["token_embd.weight"]
    lm_head = make_weight("lm_head", torch.from_numpy(embd.data.copy()), int(embd.tensor_type))
    return layers, lm_head


def make_random_weights() -> tuple[list[dict[str, Weight]], Weight]:
    gen = torch.Generator().manual_seed(0)
    layers = [
        {
            name: make_weight(name, random_blocks(n, k, gq.GGML_Q4_1, gen), gq.GGML_Q4_1)
            for name, (n, k) in LAYER_SHAPES.items()
        }
        for _ in range(NUM_LAYERS)
    ]
    return layers, make_weight("lm_head", random_blocks(VOCAB, HIDDEN, gq.GGML_Q8_0, gen), gq.GGML_Q8_0)


@dataclass
class Timing:
    median_ms: float
    min_ms: float


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]


def time_pair(
    native: Callable[[], object], dense: Callable[[], object], repeats: int, min_seconds: float
) -> tuple[Timing, Timing]:
    """Alternating rounds of native() and dense(): at least `repeats` rounds and `min_seconds`."""
    native()
    dense()
    times: tuple[list[float], list[float]] = ([], [])
    start = time.perf_counter()
    while len(times[0]) < repeats or time.perf_counter() - start < min_seconds:
        for fn, out in zip((native, dense), times):
            t0 = clock()
            fn()
            out.append((clock() - t0) * 1e3)
        if len(times[0]) >= 20 * repeats:
            break
    native_t, dense_t = (Timing(statistics.median(t), min(t)) for t in times)
    return native_t, dense_t


def gflops(m: int, n: int, k: int, ms: float) -> float:
    return 2 * m * n * k / (ms * 1e-3) / 1e9


def make_row(case: str, m: int, n: int, k: int, qtype: str, native: Timing, dense: Timing) -> Row:
    return Row(
        case,
        m,
        n,
        k,
        qtype,
        native.median_ms,
        dense.median_ms,
        native.min_ms,
        dense.min_ms,
        gflops(m, n, k, native.median_ms),
        gflops(m, n, k, dense.median_ms),
        dense.median_ms / native.median_ms,
    )


def bench_single(weight: Weight, m: int, repeats: int, min_seconds: float) -> Row:
    n, k = weight.dense.shape
    x = torch.randn(m, k)
    native, dense = time_pair(
        lambda: gq.quant_linear(x, weight.qweight, weight.qtype),
        lambda: F.linear(x, weight.dense),
        repeats,
        min_seconds,
    )
    return make_row(weight.name, m, n, k, gq.QTYPE_NAMES[weight.qtype], native, dense)


def bench_layers(
    layers: list[dict[str, Weight]], lm_head: Weight | None, m: int, repeats: int, min_seconds: float
) -> Row:
    """Each layer's four linears with its own weights, then the lm_head unless None (a prefill
    runs it on one row per request only); x is reused per shape."""
    xs = {k: torch.randn(m, k) for k in (HIDDEN, LAYER_SHAPES["down"][1])}

    def native_pass() -> None:
        for weights in layers:
            for w in weights.values():
                gq.quant_linear(xs[w.dense.shape[1]], w.qweight, w.qtype)
        if lm_head is not None:
            gq.quant_linear(xs[HIDDEN], lm_head.qweight, lm_head.qtype)

    def dense_pass() -> None:
        for weights in layers:
            for w in weights.values():
                F.linear(xs[w.dense.shape[1]], w.dense)
        if lm_head is not None:
            F.linear(xs[HIDDEN], lm_head.dense)

    flop_nk = sum(w.dense.numel() for weights in layers for w in weights.values())
    flop_nk += lm_head.dense.numel() if lm_head is not None else 0
    native, dense = time_pair(native_pass, dense_pass, repeats, min_seconds)
    # n * k of the whole pass in one "shape" so that GFLOP/s = 2 m (sum n k) / time.
    if lm_head is None:
        return make_row("30 layers", m, flop_nk, 1, "Q4_1", native, dense)
    return make_row("30 layers + lm_head", m, flop_nk, 1, "Q4_1+Q8_0", native, dense)


def print_table(rows: list[Row]) -> None:
    print(
        f"{'case':<20} {'M':>4} {'N':>6} {'K':>5} {'type':>9} {'native ms':>10} {'F.linear ms':>12} "
        f"{'native GF/s':>11} {'torch GF/s':>10} {'speed-up':>8}"
    )
    for r in rows:
        n, k = (r.n, r.k) if r.k > 1 else ("", "")
        print(
            f"{r.case:<20} {r.m:>4} {n:>6} {k:>5} {r.qtype:>9} {r.native_ms:>10.3f} {r.torch_ms:>12.3f} "
            f"{r.native_gflops:>11.1f} {r.torch_gflops:>10.1f} {r.speedup:>8.2f}"
        )


def crossover(rows: list[Row]) -> int | None:
    """Smallest M of the 30-layer pass at which F.linear is faster (None: never in the range)."""
    slower = [r.m for r in rows if r.case.startswith("30 layers") and r.speedup < 1.0]
    return min(slower) if slower else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--m", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--min-seconds", type=float, default=0.5, help="least time per measurement")
    parser.add_argument("--skip-single", action="store_true", help="only the 30-layer pass")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="cpu: process CPU time (all threads summed; with one thread, robust to other processes "
        "taking the core)",
    )
    parser.add_argument(
        "--without-lm-head",
        action="store_true",
        help="the 30-layer pass without the lm_head (as in a prefill, where the caller's threshold matters)",
    )
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    if not gq.quant_native_available():
        raise SystemExit(
            f"the native quant_linear kernel is not built ({native_cpu_ops.native_unavailable_reason()})"
        )
    torch.set_num_threads(args.threads)

    loaded = load_gguf_weights()
    source = "SmolLM2-135M-Instruct GGUF blocks" if loaded else "random blocks"
    layers, lm_head = loaded or make_random_weights()
    load_before = os.getloadavg()
    print(
        f"weights: {source}; threads {args.threads}; clock {args.clock}; isa {native_cpu_ops.native_isa()}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )

    rows = []
    for m in args.m:
        if not args.skip_single:
            for w in (*layers[0].values(), lm_head):
                rows.append(bench_single(w, m, args.repeats, args.min_seconds))
        rows.append(
            bench_layers(layers, None if args.without_lm_head else lm_head, m, args.repeats, args.min_seconds)
        )
        print_table(rows[-1:])
    print()
    print_table(rows)
    cross = crossover(rows)
    print(
        f"crossover M (F.linear faster on the 30-layer pass from): {cross if cross else 'beyond the range'}"
    )
    print(f"load average after: {os.getloadavg()}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(
                {
                    "weights": source,
                    "threads": args.threads,
                    "clock": args.clock,
                    "isa": native_cpu_ops.native_isa(),
                    "cpu": platform.processor() or platform.machine(),
                    "torch": torch.__version__,
                    "load_average_before": load_before,
                    "load_average_after": os.getloadavg(),
                    "crossover_m": cross,
                    "rows": [asdict(r) for r in rows],
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
