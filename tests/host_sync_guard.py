"""A CPU stand-in for `torch.cuda.set_sync_debug_mode("error")`: a torch function mode that
knows which tensors would live on the device and records every operation that, on a GPU, would
make the host wait for the device.

On a CPU every tensor is a host tensor, so the guard is told which ones are the device's
(`mark`: the pools, the batch's device fields, the forward's in-flight outputs) and follows
them: any tensor computed from a marked one, or made by a factory given a `device`, is marked
too. It records:

- host reads of a marked tensor: `item`, `bool`, `int`, `float`, `tolist`, `numpy`, `cpu`,
  printing, iterating, and a blocking copy of it to the host (`.to("cpu")` / `copy_` into a host
  tensor without `non_blocking=True`);
- operations whose output size depends on a marked tensor's values (`nonzero`, `unique`,
  `masked_select`, boolean-mask indexing, `repeat_interleave` without `output_size`);
- blocking host-to-device copies: `.to(...)` or `copy_` of a host tensor without
  `non_blocking=True`, `torch.tensor` / `torch.as_tensor` of host data with a `device`, and a
  host value (a Python number or a host tensor) written into a marked tensor by indexing.

What it cannot see: `.to(device)` of a host tensor that the code skips on a CPU (the engine's
`to_device` returns the host tensor itself there), `.to(some_device)` of a device tensor where
the target is the host but not written as "cpu" (on a CPU the two devices are one), and reads on
other threads (torch function modes are per thread: the CPU forward stream's worker thread is
not watched).
"""

from __future__ import annotations

import traceback
import weakref
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

_T = torch.Tensor
_HOST_READS = {
    _T.item,
    _T.__bool__,
    _T.__int__,
    _T.__float__,
    _T.__index__,
    _T.tolist,
    _T.numpy,
    _T.__array__,
    _T.cpu,
    _T.__format__,
    _T.__repr__,
    _T.__iter__,
}
_DATA_DEPENDENT = {
    torch.nonzero,
    _T.nonzero,
    torch.argwhere,
    _T.argwhere,
    torch.unique,
    _T.unique,
    torch.unique_consecutive,
    _T.unique_consecutive,
    torch.masked_select,
    _T.masked_select,
    torch.bincount,
    _T.bincount,
}
_REPEAT_INTERLEAVE = {torch.repeat_interleave, _T.repeat_interleave}
_FACTORIES = {
    torch.empty,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.arange,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.linspace,
    torch.empty_strided,
}
_FROM_HOST_DATA = {torch.tensor, torch.as_tensor}


@dataclass
class Sync:
    what: str
    stack: str

    def __str__(self) -> str:
        return f"{self.what}\n{self.stack}"


@dataclass
class HostSyncGuard(TorchFunctionMode):
    """Record (not raise: the scheduler would turn an exception into an aborted request) every
    would-be sync while the mode is active; `syncs` lists them with where they happened."""

    syncs: list[Sync] = field(default_factory=list)
    _marked: dict[int, weakref.ref] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__()

    # Marking -----------------------------------------------------------------------------------

    def mark(self, *objs) -> None:
        """Mark every tensor inside `objs` (tensors, lists, tuples, dicts, dataclasses and plain
        objects, followed five levels deep) as a device tensor; attributes whose name
        ends in `_cpu` are host copies and are skipped."""
        for obj in objs:
            self._mark_obj(obj, depth=5)

    def _mark_obj(self, obj, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            self._marked[id(obj)] = weakref.ref(obj)
        elif depth <= 0 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            return
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                self._mark_obj(x, depth - 1)
        elif isinstance(obj, dict):
            for x in obj.values():
                self._mark_obj(x, depth - 1)
        elif hasattr(obj, "__dict__"):
            for name, x in vars(obj).items():
                if not name.endswith("_cpu"):
                    self._mark_obj(x, depth - 1)

    def is_marked(self, t: object) -> bool:
        ref = self._marked.get(id(t)) if isinstance(t, torch.Tensor) else None
        return ref is not None and ref() is t

    # The mode ------------------------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        marked_in = any(self.is_marked(x) for x in flat)
        problem = self._problem(func, args, kwargs, marked_in)
        if problem is not None:
            self._record(problem)
        out = func(*args, **kwargs)
        made_on_device = func in _FACTORIES and kwargs.get("device") is not None
        # `.to(device)` of a host tensor makes a device copy (on a CPU: unless it returns itself).
        copied_in = func is _T.to and _has_device(args[1:], kwargs) and out is not args[0]
        if marked_in or made_on_device or copied_in:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._marked[id(t)] = weakref.ref(t)
        return out

    def _record(self, what: str) -> None:
        frames = [f for f in traceback.extract_stack() if not f.filename.endswith("host_sync_guard.py")]
        stack = "".join(traceback.format_list(frames[-8:]))
        self.syncs.append(Sync(what, stack))

    def _problem(self, func, args, kwargs, marked_in: bool) -> str | None:
        name = getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
        first = args[0] if args else None
        if func in _HOST_READS and self.is_marked(first):
            return f"host read of a device tensor: {name}"
        if marked_in and func in _DATA_DEPENDENT:
            return f"output size depends on device values: {name}"
        if marked_in and func in _REPEAT_INTERLEAVE and kwargs.get("output_size") is None:
            return f"repeat_interleave of device values without output_size: {name}"
        if func in (_T.to, _T.copy_):
            return self._copy_problem(func, args, kwargs, name)
        if (
            func in _FROM_HOST_DATA
            and kwargs.get("device") is not None
            and not isinstance(first, torch.Tensor)
        ):
            return f"blocking host-to-device copy: {name}(host data, device=...)"
        if func is _T.__getitem__ and self.is_marked(first) and _has_bool_index(args[1]):
            return "boolean-mask indexing of a device tensor (output size depends on its values)"
        if func is _T.__setitem__ and self.is_marked(first) and not self.is_marked(args[2]):
            return "host value written into a device tensor by indexing (a blocking host-to-device copy)"
        return None

    def _copy_problem(self, func, args, kwargs, name: str) -> str | None:
        blocking = not _non_blocking(args, kwargs)
        if func is _T.copy_:
            dst, src = args[0], args[1]
            if blocking and self.is_marked(dst) != self.is_marked(src):
                return f"blocking copy between host and device: {name}"
            return None
        if not (_has_device(args[1:], kwargs) and blocking):
            return None
        if not self.is_marked(args[0]):
            return f"blocking host-to-device copy: {name}"
        if _names_the_host(args[1:], kwargs):
            return f"blocking copy of a device tensor to the host: {name}"
        return None  # `.to(device)` of a device tensor: nothing to copy


def _non_blocking(args, kwargs) -> bool:
    if kwargs.get("non_blocking"):
        return True
    return any(x is True for x in args[1:])


def _has_device(args, kwargs) -> bool:
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(x, (str, torch.device)) for x in args)


def _names_the_host(args, kwargs) -> bool:
    """The target is written as the host ("cpu"); the engine's own device (a CPU here) is a
    `torch.device`, so `.to(self.device)` of a device tensor is not taken for a host copy."""
    return kwargs.get("device") == "cpu" or any(x == "cpu" for x in args if isinstance(x, str))


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(x, torch.Tensor) and x.dtype == torch.bool for x in items)
