"""The scheduler process: ZMQ I/O for the Scheduler, and the process entry point.

`ZmqSchedulerIO` implements the `SchedulerIO` protocol of `scheduler_io.py` over pyzmq: requests
arrive on a PULL socket the scheduler binds; `BatchTokenIDOut` goes to the detokenizer and every
other reply (`FlushCacheReqOutput`, `GetInternalStateReqOutput`, ...) straight to the tokenizer
manager."""

from __future__ import annotations

import logging
import os
import signal
import threading

import zmq

from radixengine.managers.io_struct import BatchTokenIDOut

logger = logging.getLogger(__name__)

RECV_BLOCK_MS = 50  # the longest an idle scheduler waits for input: the watchdog's tick

# At SIGTERM the hierarchical cache's queued storage writes are finished for at most this long:
# the parent SIGKILLs after utils.process.terminate_processes's 5 s.
SHUTDOWN_DRAIN_S = 3.0


class SchedulerTerminated(BaseException):
    """SIGTERM: leave the event loop (not an Exception: no handler of the loop takes it)."""


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise SchedulerTerminated


MONITOR_GRACE_S = (
    10.0  # after a failed TP collective, how long to wait for the rank monitor to name a dead rank
)


class ZmqSchedulerIO:
    def __init__(self, port_args, block_ms: int = RECV_BLOCK_MS) -> None:
        self.block_ms = block_ms
        self.context = zmq.Context(2)
        self.recv_from_tokenizer = self.context.socket(zmq.PULL)
        self.recv_from_tokenizer.bind(port_args.scheduler_input_ipc_name)
        self.send_to_detokenizer = self.context.socket(zmq.PUSH)
        self.send_to_detokenizer.connect(port_args.detokenizer_ipc_name)
        self.send_to_tokenizer = self.context.socket(zmq.PUSH)
        self.send_to_tokenizer.connect(port_args.tokenizer_ipc_name)

    def recv(self, block: bool) -> list[object]:
        """Every pending message; if `block` and none is pending, wait up to `block_ms` for one."""
        if block and not self.recv_from_tokenizer.poll(self.block_ms):
            return []
        msgs = []
        while True:
            try:
                msgs.append(self.recv_from_tokenizer.recv_pyobj(zmq.NOBLOCK))
            except zmq.Again:
                return msgs

    def send(self, msg: object) -> None:
        if isinstance(msg, BatchTokenIDOut):
            self.send_to_detokenizer.send_pyobj(msg)
        else:
            self.send_to_tokenizer.send_pyobj(msg)

    def close(self) -> None:
        for sock in (self.recv_from_tokenizer, self.send_to_detokenizer, self.send_to_tokenizer):
            sock.close(linger=0)
        self.context.term()


def run_scheduler_process(server_args, port_args, pipe_writer) -> None:
    """The scheduler process; with --tp-size N it is TP rank 0 and starts the node's other ranks
    (`scheduler_ranks.py`)."""
    from radixengine.managers import scheduler_ranks as ranks
    from radixengine.managers.scheduler_runtime import build_scheduler, ready_info, run_event_loop
    from radixengine.utils.process import watch_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent shuts us down
    watch_parent(os.getppid())
    logging.basicConfig(level=server_args.log_level.upper(), format="[scheduler] %(message)s")
    ready = threading.Event()

    def on_rank_death(message: str, rank: int) -> None:
        if not ready.is_set():
            pipe_writer.send({"status": "error", "error": message})
        ranks.exit_for_rank(message, rank)

    try:
        server_args = ranks.rank_server_args(server_args)
        monitor = ranks.start_tp_ranks(server_args, on_rank_death)
        io = ZmqSchedulerIO(port_args)
        scheduler = build_scheduler(server_args, io if monitor is None else ranks.TpLeaderIO(io))
        info = ready_info(scheduler)
    except Exception as e:  # report, then exit: the parent raises with this message
        logger.exception("scheduler failed to start")
        pipe_writer.send({"status": "error", "error": f"{type(e).__name__}: {e}"})
        return
    ready.set()
    pipe_writer.send(info)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        run_event_loop(scheduler, server_args)
    except SchedulerTerminated:
        logger.info("scheduler: SIGTERM; finishing the storage tier's queued writes")
        scheduler.tree_cache.close(SHUTDOWN_DRAIN_S)  # the process exits next: nothing else to stop
    except Exception:
        if monitor is not None:  # a collective failed: most likely a rank died; let the monitor name it
            logger.exception("a TP collective failed; waiting for the rank monitor")
            monitor.wait_for_death(MONITOR_GRACE_S)
        raise
