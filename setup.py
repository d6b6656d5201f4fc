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

setup(
    name="radixengine",
    version="0.1.0",
    description="An LLM serving engine with a radix-tree prefix cache, cache-aware scheduling and an overlap loop",
    packages=find_packages(include=["radixengine", "radixengine.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
