import os
from glob import glob

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
    "uvicorn",
    "prometheus-client",
    "tqdm",
    "psutil",
]
EXTRAS = {
    "test": ["pytest", "pytest-timeout", "openai", "httpx", "requests", "ruff", "matplotlib"],
    "cuda": ["flashinfer-python", "sgl-kernel"],
}



def native_extensions() -> tuple[list, dict]:
    """The native CPU kernels (radixengine/csrc -> radixengine._native_cpu).

    Built with torch's C++ extension support when torch is importable at build time (the
    Makefile installs with --no-build-isolation into a venv that already has torch). Tuned for
    the building machine (-march=native). RADIXENGINE_SKIP_NATIVE=1 skips it; the Python side
    then falls back to the pure-torch reference ops, and the test suite says so.
    """
    if os.environ.get("RADIXENGINE_SKIP_NATIVE") == "1":
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("radixengine: torch is not importable at build time; skipping the native CPU kernels")
        return [], {}
    ext = CppExtension(
        name="radixengine._native_cpu",
        sources=sorted(glob("radixengine/csrc/*.cpp")),
        extra_compile_args=["-O3", "-march=native", "-fopenmp"],
        extra_link_args=["-fopenmp"],
        depends=sorted(glob("radixengine/csrc/*.h")),
    )
    return [ext], {"build_ext": BuildExtension}


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
