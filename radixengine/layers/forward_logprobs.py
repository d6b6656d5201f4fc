"""The logprob results of one forward, as the requests asked for them: the chosen tokens' logprobs
and top logprobs (one row a request), and the prompt logprobs (one row a prompt position asked).
The same type holds them on the device, on the host, and as lists."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

T = TypeVar("T")
U = TypeVar("U")


@dataclass
class ForwardLogprobs(Generic[T]):
    next_token_logprobs: T | None = None  # [bs]
    next_token_top_logprobs_val: T | None = None  # [bs, max top_logprobs_num]
    next_token_top_logprobs_idx: T | None = None
    input_token_logprobs: T | None = None  # [rows]
    input_top_logprobs_val: T | None = None  # [rows, max top_logprobs_num]
    input_top_logprobs_idx: T | None = None

    def map(self, fn: Callable[[T], U]) -> ForwardLogprobs[U]:
        """`fn` applied to every field that is set."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return ForwardLogprobs(**{k: None if v is None else fn(v) for k, v in values.items()})

    def to_host(self) -> ForwardLogprobs[torch.Tensor]:
        return self.map(tensor_to_host)

    def tolist(self) -> ForwardLogprobs[list]:
        return self.map(lambda t: t.tolist())


def tensor_to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy (pinned, non-blocking) of a device tensor; a host tensor as it is."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
