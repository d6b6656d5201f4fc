"""Which kernel a CPU model's linears run, chosen once at load from the compute dtype and the CPU
(``/get_server_info`` reports the choice and why as ``linear_kernel`` / ``linear_kernel_reason``):

- ``amx``: bf16 weights packed for AMX tiles (``layers/amx_linear.py``);
- ``dpbf16``: the same packing, multiplied with AVX512-BF16 dot products where there is no AMX
  (``layers/dpbf16_linear.py``);
- ``bf16_panels``: bf16-stored weights widened to fp32 inside the native GEMM
  (``layers/bf16_linear.py``): a bf16 model on a CPU without native bf16 products, or a float32
  model whose weights hold bf16 values (a 16-bit checkpoint run in float32);
- ``torch``: ``F.linear`` (MKL / oneDNN), e.g. a float32 model, or a bf16 one with the native
  kernels off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from radixengine.layers.amx_linear import amx_linear_unavailable_reason, pack_amx_linears
from radixengine.layers.attention import native_cpu_ops
from radixengine.layers.bf16_linear import pack_bf16_linears
from radixengine.layers.dpbf16_linear import dpbf16_linear_unavailable_reason, pack_dpbf16_linears
from radixengine.utils.cpu_bf16 import bf16_matmul_support

PANELS_ENV_VAR = "RADIXENGINE_BF16_PANELS"


@dataclass(frozen=True)
class LinearPlan:
    kernel: str  # "amx", "dpbf16", "bf16_panels" or "torch"
    reason: str


def bf16_panels_unavailable_reason() -> str | None:
    """Why linears cannot run on bf16 panels here; None when they can. ``RADIXENGINE_BF16_PANELS=0``
    turns them off (the ablation)."""
    if os.environ.get(PANELS_ENV_VAR, "1") == "0":
        return f"{PANELS_ENV_VAR}=0"
    if native_cpu_ops.native_module_with("bf16_linear") is None:
        return "the native CPU kernels with bf16_linear are not built"
    return None


def plan_cpu_linears(dtype: torch.dtype) -> LinearPlan:
    """The kernel for a CPU model computing in ``dtype`` (before looking at its weights)."""
    panels_off = bf16_panels_unavailable_reason()
    if dtype == torch.bfloat16:
        if amx_linear_unavailable_reason() is None:
            return LinearPlan("amx", "bf16 weights packed for AMX tiles")
        support = bf16_matmul_support()
        dpbf16_off = dpbf16_linear_unavailable_reason()
        if support.native and dpbf16_off is None:
            return LinearPlan(
                "dpbf16", f"{support.reason}: bf16 weights packed for its dot products (vdpbf16ps)"
            )
        if support.native:
            return LinearPlan(
                "torch",
                f"{support.reason}: oneDNN's bf16 matmul (native bf16 products) runs bf16 linears "
                f"(the packed dot-product kernel is off: {dpbf16_off})",
            )
        if panels_off:
            return LinearPlan("torch", f"{support.reason}, but bf16 panels are off: {panels_off}")
        return LinearPlan(
            "bf16_panels",
            f"{support.reason}: bf16 weights widened to fp32 inside the native GEMM "
            "(torch's bf16 matmul would run without native bf16 products)",
        )
    if dtype == torch.float32 and panels_off is None:
        return LinearPlan(
            "bf16_panels",
            "float32 weights that hold bf16 values (a 16-bit checkpoint) kept as bf16 panels: "
            "half the bytes, the same products",
        )
    reason = f"bf16 panels off: {panels_off}" if panels_off else f"{dtype} linears"
    return LinearPlan("torch", reason)


def apply_cpu_linear_plan(model: nn.Module, plan: LinearPlan) -> tuple[LinearPlan, int]:
    """Pack the model's weights for ``plan``; returns the plan as it came out (a float32 model
    with no weight of bf16 values stays on torch) and how many linears were packed."""
    if plan.kernel == "amx":
        return plan, pack_amx_linears(model)
    if plan.kernel == "dpbf16":
        return plan, pack_dpbf16_linears(model)
    if plan.kernel == "bf16_panels":
        count = pack_bf16_linears(model)
        if count == 0:
            return LinearPlan("torch", "no linear weight holds only bf16 values"), 0
        return plan, count
    return plan, 0
