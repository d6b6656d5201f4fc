"""Pieces of the overlap loop: the FutureMap, and the step timer behind `--trace-file`.

FutureMap: indexed by `req_pool_idx` (as newer SGLang does), not a ring. A request has at most
one token in flight (the one its last launched batch samples), and its row in the ReqToTokenPool
is unique among running requests, so the request in row r uses placeholder `-(r + 1)` and slot
`r + 1` of the buffer. Nothing wraps around, so no slot can be overwritten before the batch that
reads it has resolved it (sglang-jax #1504 is a ring wrap-around bug), and the buffer needs no
headroom arithmetic: one slot per row. Writes and reads are ordered by the forward stream: batch
N stores its tokens after sampling, batch N+1 resolves them before its forward.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict, deque
from contextlib import contextmanager
from pathlib import Path

import torch

from radixengine.speculative.spec_overlap import FutureMapView
from radixengine.speculative.spec_verify import VerifyResult


class FutureMap:
    def __init__(self, num_rows: int, device: torch.device | str, spec_width: int = 0) -> None:
        """`spec_width` > 0 (speculative decoding): also each row's KV length and the tokens its
        last step emitted (at most `spec_width`), which a verify step launched before that
        result was processed resolves (speculative/spec_overlap.py)."""
        self.token_ids_buf = torch.zeros(num_rows + 1, dtype=torch.int64, device=device)
        self.spec: FutureMapView | None = None
        if spec_width > 0:
            self.spec = FutureMapView(
                self.token_ids_buf,
                torch.zeros(num_rows + 1, dtype=torch.int64, device=device),
                torch.full((num_rows + 1, spec_width), -1, dtype=torch.int64, device=device),
                torch.zeros(num_rows + 1, dtype=torch.int64, device=device),
            )

    @staticmethod
    def placeholders(req_pool_indices: torch.Tensor) -> torch.Tensor:
        """The stand-ins for the tokens the batch on these rows is about to sample."""
        return -(req_pool_indices + 1)

    def resolve_future(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids` with every placeholder replaced by its token (a new tensor: the
        placeholder tensor may be shared with the scheduler's batch). Run on the forward stream."""
        return torch.where(input_ids < 0, self.token_ids_buf[(-input_ids).clamp(min=0)], input_ids)

    def store_to_map(
        self,
        req_pool_indices: torch.Tensor,
        next_token_ids: torch.Tensor,
        seq_lens: torch.Tensor | None = None,
    ) -> None:
        """Run on the forward stream, after sampling; `seq_lens`: the rows' KV lengths after it."""
        idx = req_pool_indices + 1
        self.token_ids_buf[idx] = next_token_ids
        if self.spec is not None and seq_lens is not None:
            self.spec.kv_lens[idx] = seq_lens
            self.spec.emitted[idx, 0] = next_token_ids
            self.spec.emitted_len[idx] = 1

    def store_verify(
        self, req_pool_indices: torch.Tensor, result: VerifyResult, prefix_lens: torch.Tensor
    ) -> None:
        """A verify step's results: the bonus, the KV length after its accepted path, and the
        tokens it emitted (the accepted drafts and the bonus)."""
        idx = req_pool_indices + 1
        accepted = result.accept_lens
        self.token_ids_buf[idx] = result.output_ids.gather(1, accepted.view(-1, 1)).view(-1)
        self.spec.kv_lens[idx] = prefix_lens + accepted + 1
        self.spec.emitted[idx, : result.output_ids.shape[1]] = result.output_ids
        self.spec.emitted_len[idx] = accepted + 1


# Timing -----------------------------------------------------------------------------------------

PHASES = ("recv", "schedule", "draft", "launch", "forward", "verify", "process", "accept", "wait", "grammar")


class StepTimer:
    """Per step, the scheduler thread's time in each phase (nested phases are subtracted from
    their parent), and optionally the intervals for a Chrome trace. Cheap: two perf_counter
    calls per phase."""

    def __init__(self, trace: bool = False, max_events: int = 200_000) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.start_time = time.perf_counter()
        self._stack: list[list] = []
        self.events: deque[tuple[str, float, float]] | None = deque(maxlen=max_events) if trace else None

    @contextmanager
    def phase(self, name: str):
        frame = [name, time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            end = time.perf_counter()
            self._stack.pop()
            elapsed = end - frame[1]
            self.totals[name] += elapsed - frame[2]
            if self._stack:
                self._stack[-1][2] += elapsed
            if self.events is not None:
                self.events.append((name, frame[1], end))

    def end_step(self) -> None:
        self.steps += 1

    def summary(self) -> dict[str, float]:
        """Mean milliseconds per step of each phase, and of the scheduler's own CPU work (all
        phases but the forward run inline and the wait for the device)."""
        steps = max(self.steps, 1)
        out = {f"{p}_ms": 1e3 * self.totals.get(p, 0.0) / steps for p in PHASES}
        out["cpu_ms"] = sum(
            out[f"{p}_ms"] for p in ("recv", "schedule", "draft", "launch", "process", "accept")
        )
        out["steps"] = self.steps
        return out

    def reset(self) -> None:
        self.totals.clear()
        self.steps = 0
        self.start_time = time.perf_counter()
        if self.events is not None:
            self.events.clear()


def write_chrome_trace(
    path: str | Path,
    scheduler_events: list[tuple[str, float, float]],
    device_events: list[tuple[float, float, str]],
    origin: float,
) -> None:
    """Chrome trace-event JSON (chrome://tracing, Perfetto): lane 1 the scheduler thread's
    phases, lane 2 the forward stream's busy intervals. Times in perf_counter seconds."""

    def event(name: str, start: float, end: float, tid: int) -> dict:
        return {
            "name": name,
            "ph": "X",
            "ts": (start - origin) * 1e6,
            "dur": max(end - start, 0.0) * 1e6,
            "pid": 1,
            "tid": tid,
        }

    trace = [
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "radixengine scheduler"}},
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "scheduler"}},
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 2, "args": {"name": "forward stream"}},
    ]
    trace += [event(name, s, e, 1) for name, s, e in scheduler_events]
    trace += [event(label, s, e, 2) for s, e, label in device_events]
    Path(path).write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
