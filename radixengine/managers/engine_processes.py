"""The engine's child processes: the scheduler and the detokenizer, started (spawned, talking over
ZMQ ipc:// sockets in a private folder) and, after the scheduler died, started again.

`SchedulerRestarter` keeps what a restart needs (the arguments, the ipc folder) and the restart
policy: at most `--max-scheduler-restarts` restarts within `--scheduler-restart-window` seconds.
Each generation of children gets ipc names of its own, so nothing queued for a dead scheduler
reaches the new one."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from radixengine.utils.network import PortArgs
from radixengine.utils.process import terminate_processes

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT = 900.0

Children = list[tuple[str, Any]]  # (name, multiprocessing.Process)


def generation_port_args(ipc_dir: str, tokenizer_ipc_name: str, generation: int) -> PortArgs:
    """Generation 0's endpoints are PortArgs.init_new's; a restart's scheduler and detokenizer
    bind new ones (the tokenizer manager keeps its own)."""
    ports = PortArgs.init_new(ipc_dir)
    if generation == 0:
        return ports
    return PortArgs(
        tokenizer_ipc_name,
        f"{ports.scheduler_input_ipc_name}-{generation}",
        f"{ports.detokenizer_ipc_name}-{generation}",
    )


def start_children(server_args, detokenizer_args, port_args: PortArgs) -> tuple[Children, dict]:
    """Start the scheduler and the detokenizer and wait until both are ready: the processes and
    the scheduler's ready info. Ends what it started if one fails."""
    from radixengine.managers.detokenizer_manager import run_detokenizer_process
    from radixengine.managers.scheduler_process import run_scheduler_process

    ctx = mp.get_context("spawn")
    procs: list[tuple[str, Any, Any]] = []
    try:
        children = (
            ("scheduler", run_scheduler_process, server_args),
            ("detokenizer", run_detokenizer_process, detokenizer_args),
        )
        for name, target, args in children:
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=target, args=(args, port_args, writer), name=f"radixengine-{name}", daemon=True
            )
            with _main_module_spawnable():
                proc.start()
            writer.close()
            procs.append((name, proc, reader))
        infos = {name: _wait_ready(name, proc, reader) for name, proc, reader in procs}
    except BaseException:
        terminate_processes([p for _, p, _ in procs])
        raise
    return [(name, proc) for name, proc, _ in procs], infos["scheduler"]


class SchedulerRestarter:
    """Starts new children after the scheduler (or the detokenizer) died, while the policy allows."""

    def __init__(self, server_args, detokenizer_args, ipc_dir: str, tokenizer_ipc_name: str) -> None:
        self.server_args = server_args
        self.detokenizer_args = detokenizer_args
        self.ipc_dir = ipc_dir
        self.tokenizer_ipc_name = tokenizer_ipc_name
        self.max_restarts = server_args.max_scheduler_restarts
        self.window_s = server_args.scheduler_restart_window
        self.restart_times: deque[float] = deque()
        self.generation = 0

    def may_restart(self) -> bool:
        """Fewer than --max-scheduler-restarts restarts within the last window."""
        now = time.monotonic()
        while self.restart_times and now - self.restart_times[0] > self.window_s:
            self.restart_times.popleft()
        return len(self.restart_times) < self.max_restarts

    def limit_message(self) -> str:
        return (
            f"not restarted: {len(self.restart_times)} restarts within {self.window_s:g} s "
            f"(--max-scheduler-restarts {self.max_restarts}, --scheduler-restart-window {self.window_s:g})"
        )

    def restart(self, old: Children) -> tuple[Children, PortArgs]:
        """End what is left of the old children, start new ones (blocking: loads the model)."""
        self.restart_times.append(time.monotonic())
        terminate_processes([proc for _, proc in old])
        self.generation += 1
        port_args = generation_port_args(self.ipc_dir, self.tokenizer_ipc_name, self.generation)
        procs, _ = start_children(self.server_args, self.detokenizer_args, port_args)
        return procs, port_args


@contextlib.contextmanager
def _main_module_spawnable() -> Iterator[None]:
    """A spawned child re-imports the main module from its `__file__`; a script piped to `python -`
    has `__file__ == '<stdin>'`, which the child cannot open. Such a main module is hidden from
    the child as `python -c`'s is (no `__file__`: not re-imported) while it starts."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or getattr(getattr(main, "__spec__", None), "name", None) is not None:
        yield  # no file to re-import, or re-imported by module name (`python -m`)
        return
    if not os.path.isabs(path) and mp.process.ORIGINAL_DIR is not None:
        path = os.path.join(mp.process.ORIGINAL_DIR, path)
    if os.path.isfile(path):
        yield
        return
    saved = main.__file__
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = saved


def _silent_exit_reason(exitcode: int | None) -> str:
    """A child that died before it could say why: its traceback is on stderr above. The usual
    cause is a script that starts the engine at import time: the children are spawned, and each
    re-imports the main module."""
    return (
        f"it exited before it was ready (exit code {exitcode}; its error is printed above). A script "
        'that starts an Engine must do so under `if __name__ == "__main__":` (the engine\'s '
        "processes are spawned and import the main module)."
    )


def _wait_ready(name: str, proc, reader) -> dict:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if reader.poll(0.2):
            try:
                info = reader.recv()
            except EOFError:
                info = None
            if info and info.get("status") == "ready":
                return info
            proc.join(5.0)
            error = (info or {}).get("error") or _silent_exit_reason(proc.exitcode)
            raise RuntimeError(f"the {name} process failed to start: {error}")
        if not proc.is_alive():
            raise RuntimeError(f"the {name} process died during start-up (exit code {proc.exitcode})")
    raise RuntimeError(f"the {name} process was not ready after {STARTUP_TIMEOUT:.0f} s")
