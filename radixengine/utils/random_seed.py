"""`--random-seed`: what SGLang's `set_random_seed` seeds, in each process that samples."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


def set_random_seed(seed: int) -> None:
    """Seed Python's `random`, NumPy and torch (the CPU generator and every CUDA device's)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


@contextmanager
def preserved_random_state() -> Iterator[None]:
    """The generators `set_random_seed` seeds are left as they were by what runs inside (e.g. a
    model only one tensor-parallel rank builds: the ranks' generators must stay in step)."""
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    # CUDA's only once initialised (reading them would initialise CUDA in a CPU run)
    saved_cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
        if saved_cuda is not None:
            torch.cuda.set_rng_state_all(saved_cuda)
