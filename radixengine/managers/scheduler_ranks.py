"""Tensor-parallel ranks of the scheduler (SGLang's TP scheduler: every rank runs the same schedule).

Rank 0 is the scheduler process the engine starts. It starts the other ranks of its node
(`start_tp_ranks`), receives the requests from the tokenizer manager and broadcasts them to the
other ranks (`TpLeaderIO`); every rank then runs the same Scheduler on the same messages, so all
build the same batches, run the same forward (whose layers talk over torch.distributed) and sample
the same tokens; only rank 0 sends outputs (`TpFollowerIO` drops them). A node other than 0
(`--node-rank`) runs only its ranks (`run_tp_node`).

The other ranks are plain child processes (`python -m radixengine.managers.scheduler_ranks`: the
scheduler process is a daemon, which multiprocessing does not let start children). A rank that
dies ends its parent with `TP_RANK_EXIT_BASE + rank`, and the tokenizer manager names the rank
(`describe_scheduler_exit`); a rank that stops answering makes the others' collectives raise after
--watchdog-timeout (gloo's timeout).

With --test-mode the ranks also compare, before every receive, a digest of their schedulers'
requests and tokens (`scheduler_runtime.scheduler_digest`): ranks that stopped making the same decisions raise at
the first step where they differ instead of hanging in a collective or answering wrongly."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from radixengine.distributed import all_ranks_agree, broadcast_pyobj, init_distributed
from radixengine.managers.scheduler_exit import TP_RANK_EXIT_BASE
from radixengine.utils.network import get_free_port

logger = logging.getLogger(__name__)


class TpRankIO:
    """A rank's I/O; `digest` (--test-mode): its scheduler's state, compared over the ranks before
    every receive."""

    digest: Callable[[], int] | None = None

    def check_ranks_agree(self) -> None:
        if self.digest is not None and not all_ranks_agree(self.digest()):
            raise RuntimeError(
                "the TP ranks diverged: their schedulers hold different requests or tokens after the same steps"
            )


class TpLeaderIO(TpRankIO):
    """Rank 0's I/O: what the tokenizer manager sent, broadcast to every rank."""

    def __init__(self, io) -> None:
        self.io = io

    def recv(self, block: bool) -> list[object]:
        self.check_ranks_agree()
        return broadcast_pyobj(self.io.recv(block), src=0)

    def send(self, msg: object) -> None:
        self.io.send(msg)

    def close(self) -> None:
        self.io.close()


class TpFollowerIO(TpRankIO):
    """Another rank's I/O: rank 0's messages; its outputs go nowhere (rank 0 sends the same)."""

    def recv(self, block: bool) -> list[object]:
        self.check_ranks_agree()
        return broadcast_pyobj(None, src=0)

    def send(self, msg: object) -> None:
        pass


@dataclass(frozen=True)
class TpLayout:
    tp_size: int
    nnodes: int
    node_rank: int
    init_method: str

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def node_ranks(self) -> range:
        return range(self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node)

    @classmethod
    def of(cls, server_args) -> TpLayout:
        addr = server_args.dist_init_addr or f"127.0.0.1:{get_free_port()}"
        return cls(server_args.tp_size, server_args.nnodes, server_args.node_rank, f"tcp://{addr}")


def rank_server_args(server_args):
    """A rank's arguments: on a CPU without --num-threads, the node's cores shared by its ranks."""
    if server_args.tp_size == 1 or server_args.num_threads is not None or server_args.device != "cpu":
        return server_args
    cores = len(os.sched_getaffinity(0))
    per_node = server_args.tp_size // server_args.nnodes
    return dataclasses.replace(server_args, num_threads=max(1, cores // per_node))


def join_tp_group(server_args, rank: int, layout: TpLayout) -> None:
    init_distributed(
        server_args.tp_size,
        rank,
        layout.init_method,
        device=server_args.device,
        local_rank=rank - layout.node_ranks().start,
        timeout_s=server_args.watchdog_timeout,
    )


@dataclass
class RankProcess:
    rank: int
    proc: subprocess.Popen
    status_fd: int  # the rank writes its start-up error here

    def reason(self) -> str:
        try:
            os.set_blocking(self.status_fd, False)
            text = os.read(self.status_fd, 65536).decode(errors="replace").strip()
        except (BlockingIOError, OSError):
            text = ""
        return f": {text}" if text else ""


class RankMonitor:
    """Waits on each rank process of this node; the first to exit calls `on_death(message, rank)`."""

    def __init__(self, ranks: list[RankProcess], on_death: Callable[[str, int], None]) -> None:
        self.ranks = ranks
        self.on_death = on_death
        self.threads = [
            threading.Thread(target=self._wait, args=(r,), name=f"tp-rank-{r.rank}-monitor", daemon=True)
            for r in ranks
        ]
        for thread in self.threads:
            thread.start()

    def _wait(self, rank: RankProcess) -> None:
        code = rank.proc.wait()
        message = f"TP rank {rank.rank} (pid {rank.proc.pid}) exited with code {code}{rank.reason()}"
        self.on_death(message, rank.rank)

    def wait_for_death(self, timeout: float) -> None:
        for thread in self.threads:
            thread.join(timeout / max(1, len(self.threads)))


def spawn_rank(server_args, rank: int, layout: TpLayout) -> RankProcess:
    read_fd, write_fd = os.pipe()
    env = dict(os.environ)  # the rank imports this radixengine, wherever it comes from
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixengine.managers.scheduler_ranks", str(write_fd)],
        stdin=subprocess.PIPE,
        pass_fds=(write_fd,),
        env=env,
    )
    os.close(write_fd)
    proc.stdin.write(pickle.dumps((server_args, rank, layout)))
    proc.stdin.close()
    return RankProcess(rank, proc, read_fd)


def exit_for_rank(message: str, rank: int) -> None:
    logger.error("%s; the scheduler exits", message)
    logging.shutdown()
    os._exit(TP_RANK_EXIT_BASE + rank)


def start_tp_ranks(server_args, on_death: Callable[[str, int], None] = exit_for_rank) -> RankMonitor | None:
    """On rank 0 (the scheduler process): start ranks 1.. of node 0, join the group with them;
    None with one rank."""
    if server_args.tp_size == 1:
        return None
    layout = TpLayout.of(server_args)
    ranks = [spawn_rank(server_args, rank, layout) for rank in layout.node_ranks() if rank != 0]
    monitor = RankMonitor(ranks, on_death)
    join_tp_group(server_args, 0, layout)
    return monitor


def run_tp_node(server_args) -> None:
    """`--node-rank` > 0: run this node's ranks until one exits (then exit naming it)."""
    from radixengine.model_loader import resolve_model_path

    layout = TpLayout.of(server_args)
    logging.basicConfig(level=server_args.log_level.upper(), format=f"[node {layout.node_rank}] %(message)s")
    resolve_model_path(
        server_args.model_path, server_args.revision
    )  # a GGUF converted once, not by each rank
    ranks = [spawn_rank(server_args, rank, layout) for rank in layout.node_ranks()]
    logger.info("ranks %s started, meeting at %s", list(layout.node_ranks()), layout.init_method)
    died = threading.Event()
    messages: list[str] = []

    def on_death(message: str, rank: int) -> None:
        messages.append(message)
        died.set()

    RankMonitor(ranks, on_death)
    try:
        died.wait()
    finally:
        for r in ranks:
            if r.proc.poll() is None:
                r.proc.kill()
    raise SystemExit(f"{messages[0]}; this node's ranks are ended")


def _run_rank(status_fd: int) -> None:
    """A rank other than 0: its arguments come pickled on stdin."""
    from radixengine.managers.scheduler_runtime import build_scheduler, run_event_loop
    from radixengine.utils.process import watch_parent

    server_args, rank, layout = pickle.loads(sys.stdin.buffer.read())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_parent(os.getppid())
    logging.basicConfig(level=server_args.log_level.upper(), format=f"[TP{rank}] %(message)s")
    server_args = rank_server_args(server_args)
    try:
        join_tp_group(server_args, rank, layout)
        scheduler = build_scheduler(server_args, TpFollowerIO())
    except Exception as e:
        logger.exception("TP rank %d failed to start", rank)
        os.write(status_fd, f"{type(e).__name__}: {e}".encode())
        sys.exit(1)
    # Rank 0 logs the batches; the others' copies of those lines would only repeat them.
    logging.getLogger().setLevel(max(logging.getLogger().level, logging.WARNING))
    run_event_loop(scheduler, server_args)


if __name__ == "__main__":
    _run_rank(int(sys.argv[1]))
