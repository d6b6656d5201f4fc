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

import zmq

from radixengine.managers.io_struct import BatchTokenIDOut

logger = logging.getLogger(__name__)

RECV_BLOCK_MS = 50


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
    from radixengine.managers.tp_worker import TpModelWorker

    tp_worker = TpModelWorker(server_args)
    scheduler = Scheduler(server_args, tp_worker=tp_worker, tokenizer=load_tokenizer(server_args), io=io)
    return scheduler


def ready_info(scheduler) -> dict:
    """What the front end needs to validate requests: the worker's limits."""
    info = dataclasses.asdict(scheduler.tp_worker.get_worker_info())
    return {"status": "ready", **info}


def run_scheduler_process(server_args, port_args, pipe_writer) -> None:
    from radixengine.utils.process import watch_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent shuts us down
    watch_parent(os.getppid())
    logging.basicConfig(level=server_args.log_level.upper(), format="[scheduler] %(message)s")
    try:
        io = ZmqSchedulerIO(port_args)
        scheduler = build_scheduler(server_args, io)
        info = ready_info(scheduler)
    except Exception as e:  # report, then exit: the parent raises with this message
        logger.exception("scheduler failed to start")
        pipe_writer.send({"status": "error", "error": f"{type(e).__name__}: {e}"})
        return
    pipe_writer.send(info)
    overlap = getattr(scheduler, "event_loop_overlap", None)
    if server_args.disable_overlap_schedule or overlap is None:
        scheduler.event_loop_normal()
    else:
        overlap()
