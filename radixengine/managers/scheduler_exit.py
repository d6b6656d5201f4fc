"""The scheduler process's exit codes, and what the tokenizer manager says of them."""

from __future__ import annotations

WATCHDOG_EXIT_CODE = 3  # the scheduler's watchdog ended it (a step ran past --watchdog-timeout)
TP_RANK_EXIT_BASE = 64  # exit code of a process whose TP rank r died: 64 + r


def describe_scheduler_exit(exitcode: int | None, pid: int | None) -> str | None:
    """The tokenizer manager's message for a scheduler that exited because a TP rank died."""
    if exitcode is None or not TP_RANK_EXIT_BASE < exitcode < TP_RANK_EXIT_BASE + 128:
        return None
    rank = exitcode - TP_RANK_EXIT_BASE
    return (
        f"TP rank {rank} died, so the scheduler process (rank 0, pid {pid}) exited "
        "(the scheduler's log names the rank's exit code)"
    )
