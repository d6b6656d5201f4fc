"""The native CPU kernels are built per instruction-set level and the level is picked at import.

A build made on one machine must run on another: no level is compiled with -march=native, the
lower levels hold no instructions of the higher ones (checked in the built modules with objdump),
and the import loads only a level the CPU reports (RADIXENGINE_CPU_ISA may lower it).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from radixengine.layers.attention import native_cpu_ops as ops
from radixengine.utils import cpu_isa

AVX512_FLAGS = "fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512cd"

# AVX-512 in AT&T disassembly: zmm registers, mask registers, xmm/ymm 16-31, and common
# EVEX-only instructions that can run on xmm/ymm registers 0-15.
AVX512_CODE = re.compile(
    r"%zmm\d|%k[0-7]\b|%[xy]mm(1[6-9]|2\d|3[01])\b|\t(vpternlog|vperm[it]2|vrndscale|vpmov[qdw][bwd]\b"
    r"|vpmovu?s[qdw][bwd]|vpro[lr]|vpabsq|vp(max|min)[su]q|vrcp14|vrsqrt14|vscalef|vgetexp"
    r"|vfixupimm|vpcompress|vpexpand|valign[dq]|vp?blendm|vcvtu|vcvtt?p[sd]2u|vpmullq|vpsravq)"
)
# Any VEX/EVEX-encoded (AVX and later) instruction: their mnemonics all start with "v".
AVX_CODE = re.compile(r"^\s*[0-9a-f]+:\t(v[a-z0-9]+)", re.MULTILINE)


def _built_module(level: str) -> Path | None:
    spec = importlib.util.find_spec(cpu_isa.module_name(level))
    return Path(spec.origin) if spec is not None and spec.origin else None


def _needs_package_build() -> None:
    if _built_module("portable") is None:
        if os.environ.get("RADIXENGINE_ALLOW_NO_NATIVE") == "1":
            pytest.skip("RADIXENGINE_ALLOW_NO_NATIVE=1")
        pytest.fail("the native CPU modules are not built (`pip install --no-build-isolation -e .`)")


# ----------------------------------------------------------------------------------------------
# Choosing the level


def test_levels_from_cpu_flags() -> None:
    assert cpu_isa.levels_for_flags(AVX512_FLAGS.split()) == ("portable", "avx2", "avx512")
    assert cpu_isa.levels_for_flags("sse2 avx avx2 fma f16c".split()) == ("portable", "avx2")
    assert cpu_isa.levels_for_flags("sse2 avx avx2 fma".split()) == ("portable",)  # no F16C
    no_bw = AVX512_FLAGS.replace("avx512bw", "").split()  # Knights Landing: F without BW/VL/DQ
    assert cpu_isa.levels_for_flags(no_bw) == ("portable", "avx2")
    assert cpu_isa.levels_for_flags([]) == ("portable",)


def test_cpuinfo_parsing() -> None:
    text = f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {AVX512_FLAGS}\n\nprocessor\t: 1\n"
    assert cpu_isa.parse_cpuinfo_flags(text) == frozenset(AVX512_FLAGS.split())
    assert cpu_isa.parse_cpuinfo_flags("processor\t: 0\nFeatures\t: fp asimd\n") is None


def test_other_architectures_get_the_portable_level(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_isa.build_levels("aarch64") == ("portable",)
    assert cpu_isa.build_levels("x86_64") == cpu_isa.LEVELS
    assert cpu_isa.build_levels("AMD64") == cpu_isa.LEVELS
    monkeypatch.setattr(cpu_isa.platform, "machine", lambda: "arm64")
    assert cpu_isa.supported_levels() == ("portable",)


def test_supported_levels_on_this_machine() -> None:
    levels = cpu_isa.supported_levels()
    assert levels[0] == "portable" and levels == cpu_isa.LEVELS[: len(levels)]
    flags = cpu_isa._linux_cpu_flags()
    if flags is not None and cpu_isa.is_x86_64():
        assert ("avx512" in levels) == ({"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags)


def test_select_level(caplog: pytest.LogCaptureFixture) -> None:
    all_levels = cpu_isa.LEVELS
    assert cpu_isa.select_level(None, all_levels)[0] == "avx512"
    assert cpu_isa.select_level("", ("portable", "avx2"))[0] == "avx2"
    assert cpu_isa.select_level("avx2", all_levels)[0] == "avx2"
    assert cpu_isa.select_level(" Portable ", all_levels)[0] == "portable"
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger=cpu_isa.__name__):
        level, why = cpu_isa.select_level("avx512", ("portable", "avx2"))
    assert level == "avx2" and "lowered" in why
    assert "does not support" in caplog.text and "avx512bw" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=cpu_isa.__name__):
        assert cpu_isa.select_level("sse9", all_levels)[0] == "avx512"
    assert "ignoring RADIXENGINE_CPU_ISA='sse9'" in caplog.text


def test_no_level_is_built_for_the_build_machine() -> None:
    """The package build and the JIT build use the fixed per-level flags, never -march=native,
    and the JIT build of each level has a name (so a cache directory) of its own."""
    names = set()
    for level in cpu_isa.LEVELS:
        options = ops.jit_build_options(level)
        assert not any(f.startswith(("-march", "-mtune=native")) for f in options["extra_cflags"])
        assert set(cpu_isa.COMPILE_FLAGS[level]) <= set(options["extra_cflags"])
        assert level in options["name"]
        names.add(options["name"])
    assert len(names) == len(cpu_isa.LEVELS)
    assert not any(f.startswith("-march") for flags in cpu_isa.COMPILE_FLAGS.values() for f in flags)
    with pytest.raises(ValueError, match="unknown CPU ISA level"):
        ops.jit_build_options("native")


def test_a_level_the_cpu_lacks_is_never_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_isa, "supported_levels", lambda: ("portable",))
    with pytest.raises(RuntimeError, match="cannot run"):
        ops.load_native_level("avx2")


# ----------------------------------------------------------------------------------------------
# The built modules


def _disassembly(level: str) -> str:
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump not installed")
    _needs_package_build()
    path = _built_module(level)
    assert path is not None, f"{cpu_isa.module_name(level)} is not built"
    result = subprocess.run(
        [objdump, "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True, check=True
    )
    return result.stdout


def _offending_functions(disassembly: str, pattern: re.Pattern[str]) -> list[str]:
    """Names of the functions with a line that matches ``pattern`` (the first few)."""
    found, function = [], "?"
    for line in disassembly.splitlines():
        if line.endswith(">:"):
            function = line
        elif pattern.search(line) and function not in found:
            found.append(function)
    return found[:5]


def test_avx2_level_holds_no_avx512_instructions() -> None:
    """Before the per-level build the one module (-march=native) held AVX-512 even in pybind11's
    registration code, which runs at import: SIGILL on a CPU without AVX-512."""
    assert _offending_functions(_disassembly("avx2"), AVX512_CODE) == []


def test_portable_level_holds_no_avx_instructions() -> None:
    assert _offending_functions(_disassembly("portable"), AVX_CODE) == []


def test_avx512_level_uses_avx512() -> None:
    assert _offending_functions(_disassembly("avx512"), AVX512_CODE)


@pytest.mark.parametrize("requested", [*cpu_isa.LEVELS, "bogus"])
def test_import_loads_only_the_chosen_level(requested: str) -> None:
    """A fresh interpreter with RADIXENGINE_CPU_ISA set imports that level's module and no other,
    or the CPU's highest level (with a warning) for a level it lacks or an unknown name."""
    _needs_package_build()
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from radixengine.layers.attention import native_cpu_ops as ops\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('radixengine._native_cpu'))\n"
        "print(ops.native_level(), ops.native_isa(), *loaded)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RADIXENGINE_JIT_BUILD"}
    env[cpu_isa.ENV_VAR] = requested
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    supported = cpu_isa.supported_levels()
    expected = requested if requested in supported else supported[-1]
    assert result.stdout.split() == [expected, expected, cpu_isa.module_name(expected)]
    assert f"native CPU kernels: {expected}" in result.stderr
    assert ("WARNING" in result.stderr) == (requested not in supported)
