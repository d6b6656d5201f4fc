"""bf16 linears on AVX512-BF16 dot products, for CPUs that have them and no AMX (AMD Zen 4 and
later): each weight packed once after loading into the AMX tile layout (``amx_linear.py``), whose
64-byte rows — 16 outputs x a pair of inputs — are exactly the weight operand of ``vdpbf16ps``
(``radixengine/csrc/cpu_dpbf16_linear.cpp``). Products of bf16 pairs, fp32 sums, rounded once to
bf16, as oneDNN's bf16 matmul computes; faster than it at a decode step's rows (it has no per-call
setup and reads a weight packed once) and even with it on prefill chunks (docs/benchmarks.md,
"AVX512-BF16 linears"), so the float weight is dropped. ``amx_linear_reference`` is the same
product in pure torch, from the packed weight.
"""

from __future__ import annotations

import logging
import os

from torch import nn

from radixengine.layers.amx_linear import packable
from radixengine.layers.attention import native_cpu_ops
from radixengine.layers.packed_weight import PackedWeight, pack_linears

logger = logging.getLogger(__name__)

ENV_VAR = "RADIXENGINE_DPBF16_LINEAR"


def dpbf16_linear_unavailable_reason() -> str | None:
    """Why bf16 linears cannot run on AVX512-BF16 dot products in this process; None when they
    can. ``RADIXENGINE_DPBF16_LINEAR=0`` turns them off (the ablation: oneDNN's bf16 matmul)."""
    if os.environ.get(ENV_VAR, "1") == "0":
        return f"{ENV_VAR}=0"
    native = native_cpu_ops.native_module_with("dpbf16_linear")
    if native is None:
        return "the native CPU kernels with dpbf16_linear are not built"
    if not native.dpbf16_available():
        return f"this CPU (or the loaded {native_cpu_ops.native_isa()} build) has no AVX512-BF16"
    return None


class DpBf16Weight(PackedWeight):
    """A linear's weight in the AMX tile layout, multiplied with AVX512-BF16 dot products."""

    PACK_OP = "amx_pack_linear_weight"
    LINEAR_OP = "dpbf16_linear"


def pack_dpbf16_linears(model: nn.Module) -> int:
    """Pack the bf16 weight of every module that takes a packed weight (linears, the LM head, a
    tied embedding's copy) and whose weight fits the layout (both dimensions multiples of 32);
    a module's float weight is dropped unless it also serves as an embedding. Returns how many
    were packed."""
    count = pack_linears(model, DpBf16Weight, lambda module, weight: packable(weight))
    logger.info("bf16 weights of %d linears packed for AVX512-BF16 dot products", count)
    return count
