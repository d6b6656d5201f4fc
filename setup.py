import importlib.util
import os
from glob import glob
from pathlib import Path
from types import ModuleType

from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    "torch>=2.4",
    "numpy",
    "pyzmq",
    "transformers>=4.45",
    "safetensors",
    "gguf",
    "accelerate",
    "jinja2",
    "fastapi",
    "python-multipart",  # /v1/files uploads
    "uvicorn",
    "prometheus-client",
    "tqdm",
    "psutil",
    "xgrammar==0.2.8",
]
EXTRAS = {
    "test": [
        "pytest",
        "pytest-timeout",
        "openai",
        "httpx",
        "requests",
        "ruff",
        "matplotlib",
        "sglang-router==0.3.2",
        "jsonschema",
        "llguidance==1.9.1",
        "langchain-openai",  # tests/test_responses_api.py: ChatOpenAI(use_responses_api=True)
        "litellm",  # tests/test_responses_api.py: litellm.responses()
        "peft",  # tests/test_lora_*.py: the LoRA reference (transformers + peft)
    ],
    "llguidance": ["llguidance==1.9.1"],
}


def load_cpu_isa() -> ModuleType:
    """radixengine/utils/cpu_isa.py (levels and their compiler flags), loaded by path so that the
    build does not import the package."""
    path = Path(__file__).resolve().parent / "radixengine" / "utils" / "cpu_isa.py"
    spec = importlib.util.spec_from_file_location("radixengine_build_cpu_isa", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def requested_levels(cpu_isa: ModuleType) -> tuple[str, ...]:
    """The levels to build: all this architecture has, or RADIXENGINE_NATIVE_LEVELS (a comma
    list, e.g. `portable,avx2`, for a quicker development build)."""
    levels = cpu_isa.build_levels()
    wanted = os.environ.get("RADIXENGINE_NATIVE_LEVELS")
    if not wanted:
        return levels
    chosen = tuple(level.strip() for level in wanted.split(",") if level.strip())
    for level in chosen:
        if level not in levels:
            raise SystemExit(f"RADIXENGINE_NATIVE_LEVELS: {level!r} is not one of {', '.join(levels)}")
    return chosen


def native_extensions() -> tuple[list, dict]:
    """The native CPU kernels (radixengine/csrc), once per instruction-set level:
    radixengine._native_cpu_avx512, _native_cpu_avx2 and _native_cpu_portable (only the last off
    x86-64). No -march=native: the build runs on any CPU, and the package loads the highest level
    the running CPU supports (radixengine/utils/cpu_isa.py).

    Built with torch's C++ extension support when torch is importable at build time (the
    Makefile installs with --no-build-isolation into a venv that already has torch).
    RADIXENGINE_SKIP_NATIVE=1 skips it; the Python side then falls back to the pure-torch
    reference ops, and the test suite says so.
    """
    if os.environ.get("RADIXENGINE_SKIP_NATIVE") == "1":
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("radixengine: torch is not importable at build time; skipping the native CPU kernels")
        return [], {}
    cpu_isa = load_cpu_isa()
    exts = [
        CppExtension(
            name=cpu_isa.module_name(level),
            sources=sorted(glob("radixengine/csrc/*.cpp")),
            extra_compile_args=["-O3", *cpu_isa.COMPILE_FLAGS[level], "-fopenmp"],
            extra_link_args=["-fopenmp"],
            depends=sorted(glob("radixengine/csrc/*.h")),
        )
        for level in requested_levels(cpu_isa)
    ]

    class BuildPerLevel(BuildExtension):
        """Compiles each level in its own temporary directory (the levels share their sources, so
        their object files would otherwise overwrite each other); one extension at a time."""

        def build_extensions(self) -> None:
            self.parallel = None
            super().build_extensions()

        def build_extension(self, ext) -> None:
            shared = self.build_temp
            self.build_temp = os.path.join(shared, ext.name.rsplit(".", 1)[-1])
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = shared

        def copy_file(self, infile, outfile, *args, **kwargs):
            # Replace a built module in the source tree instead of writing into it: a process
            # that has the old one loaded keeps its own copy (writing into it can crash it).
            if str(outfile).endswith(".so") and os.path.isfile(outfile):
                os.unlink(outfile)
            return super().copy_file(infile, outfile, *args, **kwargs)

    return exts, {"build_ext": BuildPerLevel}


EXT_MODULES, CMDCLASS = native_extensions()

setup(
    name="radixengine",
    version="0.1.0",
    description="An LLM serving engine with a radix-tree prefix cache, cache-aware scheduling and an overlap loop",
    packages=find_packages(include=["radixengine", "radixengine.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    ext_modules=EXT_MODULES,
    cmdclass=CMDCLASS,
)
