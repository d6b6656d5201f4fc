"""What the Triton kernels' tests share: the device they run on, and the mark that runs them on a
CPU only under Triton's interpreter (tests/test_triton_interpreted.py sets TRITON_INTERPRET=1 in a
child pytest: Triton reads it once, at import)."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
on_gpu_or_interpreted = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="on a CPU under TRITON_INTERPRET=1 only (tests/test_triton_interpreted.py runs it so)",
)
