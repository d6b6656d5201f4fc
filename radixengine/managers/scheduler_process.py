"""The scheduler process: ZMQ I/O for the Scheduler, and the process entry point.

`ZmqSchedulerIO` implements the `SchedulerIO` protocol of `scheduler_io.py` over pyzmq: requests
arrive on a PULL socket the scheduler binds; `BatchTokenIDOut` goes to the detokenizer and every
other reply (`FlushCacheReqOutput`, `GetInternalStateReqOutput`, ...) straight to the tokenizer
manager."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time

import zmq

from radixengine.managers.io_struct import BatchTokenIDOut

logger = logging.getLogger(__name__)

RECV_BLOCK_MS = 50
WATCHDOG_EXIT_CODE = 3  # the tokenizer manager names the watchdog when the scheduler exits with it
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


def build_scheduler(server_args, io: ZmqSchedulerIO):
    """The TpModelWorker and the Scheduler, with the scheduler's outputs going to `io`."""
    from radixengine.managers.scheduler import Scheduler
    from radixengine.managers.tokenizer_manager import load_tokenizer
    from radixengine.model_executor.tp_worker import TpModelWorker

    tp_worker = TpModelWorker(server_args)
    scheduler = Scheduler(server_args, tp_worker=tp_worker, tokenizer=load_tokenizer(server_args), io=io)
    return scheduler


class SchedulerWatchdog:
    """SGLang's watchdog: a daemon thread that ends the scheduler process when one step of its
    event loop (a forward batch, with its result) has run longer than `--watchdog-timeout`. The
    loop never waits longer than `RECV_BLOCK_MS` when idle, so a step counter that stops moving
    means a step that hangs. It exits with `WATCHDOG_EXIT_CODE`: the tokenizer manager then fails
    every pending request with a message naming the timeout (and the server exits)."""

    def __init__(self, scheduler, timeout: float) -> None:
        self.scheduler = scheduler
        self.timeout = timeout
        self.thread = threading.Thread(target=self._run, name="scheduler-watchdog", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        last_ct, last_time = self.scheduler.step_ct, time.monotonic()
        while True:
            time.sleep(min(self.timeout / 2, 5.0))
            ct, now = self.scheduler.step_ct, time.monotonic()
            if ct != last_ct:
                last_ct, last_time = ct, now
            elif now - last_time > self.timeout:
                self._fire(now - last_time)

    def _fire(self, stalled_s: float) -> None:
        batch = self.scheduler.cur_batch
        size = f" of {batch.batch_size()} requests" if batch is not None else ""
        message = (
            f"Scheduler watchdog timeout (--watchdog-timeout {self.timeout:g} s): a forward batch{size} "
            f"ran for {stalled_s:.0f} s without finishing; the scheduler process exits"
        )
        logger.error(message)
        logging.shutdown()  # flush the handlers: os._exit skips it
        os._exit(WATCHDOG_EXIT_CODE)  # the main thread is stuck in the forward: end the process from here


def ready_info(scheduler) -> dict:
    """What the front end needs to validate requests: the worker's limits."""
    info = dataclasses.asdict(scheduler.tp_worker.get_worker_info())
    return {"status": "ready", **info}


def run_scheduler_process(server_args, port_args, pipe_writer) -> None:
    """The scheduler process; with --tp-size N it is TP rank 0 and starts the node's other ranks
    (`scheduler_ranks.py`)."""
    from radixengine.managers.scheduler_ranks import (
        TpLeaderIO,
        exit_for_rank,
        rank_server_args,
        start_tp_ranks,
    )
    from radixengine.utils.process import watch_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent shuts us down
    watch_parent(os.getppid())
    logging.basicConfig(level=server_args.log_level.upper(), format="[scheduler] %(message)s")
    ready = threading.Event()

    def on_rank_death(message: str, rank: int) -> None:
        if not ready.is_set():
            pipe_writer.send({"status": "error", "error": message})
        exit_for_rank(message, rank)

    try:
        server_args = rank_server_args(server_args)
        monitor = start_tp_ranks(server_args, on_rank_death)
        io = ZmqSchedulerIO(port_args)
        scheduler = build_scheduler(server_args, io if monitor is None else TpLeaderIO(io))
        info = ready_info(scheduler)
    except Exception as e:  # report, then exit: the parent raises with this message
        logger.exception("scheduler failed to start")
        pipe_writer.send({"status": "error", "error": f"{type(e).__name__}: {e}"})
        return
    ready.set()
    pipe_writer.send(info)
    try:
        run_event_loop(scheduler, server_args)
    except Exception:
        if monitor is not None:  # a collective failed: most likely a rank died; let the monitor name it
            logger.exception("a TP collective failed; waiting for the rank monitor")
            monitor.wait_for_death(MONITOR_GRACE_S)
        raise


def run_event_loop(scheduler, server_args) -> None:
    SchedulerWatchdog(scheduler, server_args.watchdog_timeout)
    overlap = getattr(scheduler, "event_loop_overlap", None)
    if server_args.disable_overlap_schedule or overlap is None:
        scheduler.event_loop_normal()
    else:
        overlap()
