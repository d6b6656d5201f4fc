"""The Triton kernels' tests on a CPU (CI): Triton runs a kernel in its interpreter only when
TRITON_INTERPRET=1 is set before it is imported, so those modules run in a child pytest with it;
this process's CPU path never sees Triton. On a GPU the modules run directly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
INTERPRETED = [
    "tests/test_triton_extend_attention.py",
    "tests/test_triton_rope_kv.py",
    "tests/test_triton_decode_launches.py",
    "tests/test_triton_lora_delta.py",
    # The decode kernel's tests of the GPU module (RADIXENGINE_GPU_TEST_DEVICE=cpu runs them here).
    "tests/test_gpu_backends.py::test_decode_attention_kernel_matches_sdpa",
    "tests/test_gpu_backends.py::test_decode_attention_kernel_sliding_window_and_soft_cap",
]


@pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="the modules run directly (on the GPU, or already under the interpreter)",
)
def test_triton_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "RADIXENGINE_GPU_TEST_DEVICE": "cpu",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", *INTERPRETED],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail.splitlines()[-1], tail
