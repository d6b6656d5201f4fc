"""Host data onto the device without a host sync: a pinned staging copy and a non-blocking copy
on the current stream (on a CPU device the host tensor itself). A plain `torch.tensor(values,
device="cuda")` or `t.to("cuda")` from pageable memory waits for the stream first."""

from __future__ import annotations

import torch


def host_tensor(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype)` on `device`, copied without a host sync."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`, copied without a host sync (a device tensor as it is)."""
    device = torch.device(device)
    if t.device == device or device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
