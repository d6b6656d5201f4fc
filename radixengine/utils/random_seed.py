"""`--random-seed`: what SGLang's `set_random_seed` seeds, in each process that samples."""

from __future__ import annotations

import random

import numpy as np
import torch


def set_random_seed(seed: int) -> None:
    """Seed Python's `random`, NumPy and torch (the CPU generator and every CUDA device's)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
