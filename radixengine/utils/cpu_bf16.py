"""Whether torch's bf16 matmul runs native bf16 products on this CPU (AMX-BF16 or AVX512-BF16),
and why: the compute dtype ``--dtype auto`` picks and the kernel a bf16 linear takes follow it.

Measured on an AMD EPYC (AVX-512 + AVX512-BF16, no AMX), one thread, SmolLM2-135M's linears
(``benchmarks/bench_bf16_linear.py``): with AVX512-BF16 oneDNN's bf16 matmul takes 0.45x the
time of the fp32 one from 32 rows up; capped to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``, an AVX2 CPU's
view) it takes 4-5x the fp32 time. Only the standard library is imported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from radixengine.utils import cpu_isa

ONEDNN_ENV_VAR = "ONEDNN_MAX_CPU_ISA"
# oneDNN ISA caps that leave out its bf16 instructions (AVX512_CORE_BF16 and above have them).
_ONEDNN_CAPS_WITHOUT_BF16 = frozenset(
    {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
)
_BF16_FLAGS = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"))


@dataclass(frozen=True)
class Bf16Matmul:
    native: bool  # torch's bf16 matmul has native bf16 products here
    reason: str


def bf16_matmul_support(flags: frozenset[str] | None = None, env: dict[str, str] | None = None) -> Bf16Matmul:
    """From the CPU's flags (default: /proc/cpuinfo), ``RADIXENGINE_CPU_ISA`` (a level below
    avx512 runs as a CPU of that level) and ``ONEDNN_MAX_CPU_ISA`` (a cap below bf16)."""
    env = dict(os.environ) if env is None else env
    if flags is None:
        flags = cpu_isa.cpu_flags()
    level, _ = cpu_isa.select_level(env.get(cpu_isa.ENV_VAR), cpu_isa.levels_for_flags(flags))
    names = [name for flag, name in _BF16_FLAGS if flag in flags]
    if not names:
        return Bf16Matmul(False, "this CPU has no AMX-BF16 or AVX512-BF16")
    if level != "avx512":
        return Bf16Matmul(False, f"{cpu_isa.ENV_VAR}={level}: runs as a CPU of that level (no {names[0]})")
    cap = env.get(ONEDNN_ENV_VAR, "").strip().upper()
    if cap in _ONEDNN_CAPS_WITHOUT_BF16:
        return Bf16Matmul(False, f"{ONEDNN_ENV_VAR}={cap} keeps oneDNN off its bf16 instructions")
    return Bf16Matmul(True, f"this CPU has {' and '.join(names)}")
