"""Child-process helpers: private IPC directory, parent-death watch, killing a process tree."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
import time

logger = logging.getLogger(__name__)


def make_ipc_dir() -> str:
    """A private (0700) temporary directory for the ipc:// sockets of one engine."""
    return tempfile.mkdtemp(prefix="radixengine-ipc-")


def remove_ipc_dir(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


def watch_parent(parent_pid: int, interval: float = 0.5) -> threading.Thread:
    """Kill this process (and its children) as soon as `parent_pid` is gone. (Polling, not
    PR_SET_PDEATHSIG: that one fires when the parent *thread* that started us exits.)"""

    def run() -> None:
        while True:
            if os.getppid() != parent_pid or not _pid_alive(parent_pid):
                logger.warning("parent process %d is gone; exiting", parent_pid)
                kill_process_tree(os.getpid(), include_parent=True)
                os._exit(1)
            time.sleep(interval)

    thread = threading.Thread(target=run, name="watch-parent", daemon=True)
    thread.start()
    return thread


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_process_tree(pid: int, include_parent: bool = True, sig: int = signal.SIGKILL) -> None:
    """Send `sig` to every descendant of `pid` (and to `pid` itself if asked)."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dependency
        if include_parent:
            _signal(pid, sig)
        return
    try:
        parent = psutil.Process(pid)
        children = parent.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for child in children:
        _signal(child.pid, sig)
    if include_parent:
        _signal(pid, sig)


def terminate_processes(procs: list, timeout: float = 5.0) -> None:
    """SIGTERM each multiprocessing.Process (and its children), wait, then SIGKILL what is left."""
    for proc in procs:
        if proc.pid is not None and proc.is_alive():
            kill_process_tree(proc.pid, include_parent=False)
            _signal(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        if proc.pid is None:
            continue
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            kill_process_tree(proc.pid, include_parent=True)
            proc.join(1.0)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
