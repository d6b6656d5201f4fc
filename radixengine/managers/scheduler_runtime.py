"""Building and running a scheduler in its process (rank 0 and the other TP ranks alike): the
worker and the scheduler, the watchdog, the event loop the scheduler was built for."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import zlib

from radixengine.managers.scheduler import Scheduler
from radixengine.managers.scheduler_exit import WATCHDOG_EXIT_CODE
from radixengine.managers.scheduler_io import SchedulerIO
from radixengine.managers.served_model import load_tokenizer
from radixengine.model_executor.tp_worker import TpModelWorker
from radixengine.server_args import ServerArgs

logger = logging.getLogger("radixengine.managers.scheduler_process")


def scheduler_digest(scheduler: Scheduler) -> int:
    """What every rank's scheduler must hold alike after a step: its step count, the requests of
    its running, last and waiting batches, their output tokens and verify steps."""
    batches = (scheduler.running_batch, scheduler.last_batch)
    reqs = [r for b in batches if b is not None for r in b.reqs] + list(scheduler.waiting_queue)
    state = (scheduler.step_ct, [(r.rid, r.output_ids, r.spec_verify_ct) for r in reqs])
    return zlib.crc32(repr(state).encode())


def build_scheduler(server_args: ServerArgs, io: SchedulerIO) -> Scheduler:
    """The TpModelWorker and the Scheduler, with the scheduler's outputs going to `io`."""
    tp_worker = TpModelWorker(server_args)
    scheduler = Scheduler(server_args, tp_worker=tp_worker, tokenizer=load_tokenizer(server_args), io=io)
    if server_args.test_mode and server_args.tp_size > 1:  # io: a TpLeaderIO or TpFollowerIO
        io.digest = lambda: scheduler_digest(scheduler)  # compared over the ranks every step
    return scheduler


class SchedulerWatchdog:
    """SGLang's watchdog: a daemon thread that ends the scheduler process when one step of its
    event loop (a forward batch, with its result) has run longer than `--watchdog-timeout`. The
    loop never waits longer than `scheduler_process.RECV_BLOCK_MS` when idle, so a step counter that stops moving
    means a step that hangs. It exits with `WATCHDOG_EXIT_CODE`: the tokenizer manager then fails
    every pending request with a message naming the timeout (and the HTTP server starts a new
    scheduler, as --max-scheduler-restarts allows)."""

    def __init__(self, scheduler: Scheduler, timeout: float) -> None:
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


def ready_info(scheduler: Scheduler) -> dict:
    """What the front end needs to validate requests: the worker's limits."""
    info = dataclasses.asdict(scheduler.tp_worker.get_worker_info())
    return {"status": "ready", **info}


def run_event_loop(scheduler: Scheduler, server_args: ServerArgs) -> None:
    SchedulerWatchdog(scheduler, server_args.watchdog_timeout)
    if scheduler.enable_overlap:
        scheduler.event_loop_overlap()
    else:
        scheduler.event_loop_normal()
