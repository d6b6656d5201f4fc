"""Instruction-set levels of the native CPU kernels, and which one this CPU runs.

The kernels of ``radixengine/csrc`` are built once per level, each into its own module
``radixengine._native_cpu_<level>``:

- ``avx512``: AVX-512 F/BW/VL/DQ, AVX2, FMA, F16C (16-lane vectors)
- ``avx2``: AVX2, FMA, F16C (8-lane vectors)
- ``portable``: the architecture's baseline (x86-64: SSE2), plain loops

No level is compiled with ``-march=native``, so a build made on one machine runs on any other
that has the level's features. At import the highest level this CPU supports is picked (Linux:
the ``flags`` line of ``/proc/cpuinfo``, which the kernel clears of features the OS does not
enable; other x86 systems: ``torch.backends.cpu.get_cpu_capability()``; other architectures:
``portable``), and only that level's module is loaded, so no code with instructions the CPU lacks
is ever mapped in.

``RADIXENGINE_CPU_ISA=portable|avx2|avx512`` asks for a level. A level above what the CPU
supports is lowered to the CPU's highest level with a warning (never loaded, since that would end
the process with SIGILL); an unknown value is ignored with a warning (as torch does with
``ATEN_CPU_CAPABILITY``).

Only the standard library is imported at module level: ``setup.py`` loads this file by path for
the per-level compiler flags.
"""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Iterable

logger = logging.getLogger(__name__)

ENV_VAR = "RADIXENGINE_CPU_ISA"
LEVELS: tuple[str, ...] = ("portable", "avx2", "avx512")  # lowest first
MODULE_PREFIX = "radixengine._native_cpu_"

# Compiler flags per level (on top of -O3 -fopenmp); each level's code paths in csrc are chosen
# by the macros these flags define (__AVX512F__, __AVX2__ + __FMA__ + __F16C__).
COMPILE_FLAGS: dict[str, tuple[str, ...]] = {
    "portable": (),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"),
}

# /proc/cpuinfo flags a level needs: every feature its compiler flags enable.
REQUIRED_CPU_FLAGS: dict[str, frozenset[str]] = {
    "portable": frozenset(),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}),
}

_X86_MACHINES = frozenset({"x86_64", "amd64", "x64"})
_TORCH_CAPABILITY_LEVEL = {"AVX512": "avx512", "AVX2": "avx2"}


def is_x86_64(machine: str | None = None) -> bool:
    """Whether ``machine`` (default: this one, ``platform.machine()``) is x86-64."""
    return (machine if machine is not None else platform.machine()).lower() in _X86_MACHINES


def build_levels(machine: str | None = None) -> tuple[str, ...]:
    """The levels a package build compiles on ``machine``: all on x86-64, else ``portable``."""
    return LEVELS if is_x86_64(machine) else ("portable",)


def module_name(level: str) -> str:
    """The extension module of a level, e.g. ``radixengine._native_cpu_avx2``."""
    check_level(level)
    return MODULE_PREFIX + level


def check_level(level: str) -> None:
    if level not in LEVELS:
        raise ValueError(f"unknown CPU ISA level {level!r} (one of {', '.join(LEVELS)})")


def levels_for_flags(flags: Iterable[str]) -> tuple[str, ...]:
    """The levels whose required CPU features are all among ``flags`` (lowest first)."""
    have = frozenset(flags)
    return tuple(level for level in LEVELS if REQUIRED_CPU_FLAGS[level] <= have)


def parse_cpuinfo_flags(text: str) -> frozenset[str] | None:
    """The feature flags of the first processor in /proc/cpuinfo text; None if there are none."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return None


def _linux_cpu_flags() -> frozenset[str] | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return parse_cpuinfo_flags(f.read())
    except OSError:
        return None


def _torch_capability_levels() -> tuple[str, ...]:
    try:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # no torch, or a torch without the query: assume the baseline
        return ("portable",)
    top = _TORCH_CAPABILITY_LEVEL.get(capability, "portable")
    return LEVELS[: LEVELS.index(top) + 1]


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux: /proc/cpuinfo; elsewhere: none known)."""
    flags = _linux_cpu_flags() if platform.system() == "Linux" and is_x86_64() else None
    return flags if flags is not None else frozenset()


def supported_levels() -> tuple[str, ...]:
    """The levels this CPU can run, lowest first (always includes ``portable``)."""
    if not is_x86_64():
        return ("portable",)
    flags = _linux_cpu_flags() if platform.system() == "Linux" else None
    if flags is not None:
        return levels_for_flags(flags)
    return _torch_capability_levels()


def select_level(requested: str | None, supported: tuple[str, ...]) -> tuple[str, str]:
    """The level to load and why: ``requested`` (the env var's value, may be None) if the CPU
    supports it, else the highest supported level (with a warning when one was requested)."""
    best = supported[-1]
    if not requested:
        return best, f"highest level this CPU supports of {', '.join(LEVELS)}"
    wanted = requested.strip().lower()
    if wanted not in LEVELS:
        logger.warning("ignoring %s=%r (expected one of %s)", ENV_VAR, requested, ", ".join(LEVELS))
        return best, f"highest level this CPU supports ({ENV_VAR}={requested!r} ignored)"
    if wanted not in supported:
        needs = ", ".join(sorted(REQUIRED_CPU_FLAGS[wanted]))
        logger.warning(
            "%s=%s: this CPU does not support it (needs %s); using %s", ENV_VAR, wanted, needs, best
        )
        return best, f"{ENV_VAR}={wanted} lowered to what this CPU supports"
    return wanted, f"{ENV_VAR}={wanted}"


def chosen_level() -> tuple[str, str]:
    """The level to load on this machine (see ``select_level``), from the environment."""
    return select_level(os.environ.get(ENV_VAR), supported_levels())
