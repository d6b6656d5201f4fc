"""Host syncs per decode step of the normal and the overlap loop, counted on a GPU with
`torch.cuda.set_sync_debug_mode("warn")` (each synchronizing CUDA call is one warning).

    python benchmarks/count_syncs.py --model smollm2 --bs 8 --new-tokens 16 --out syncs.json

Per loop: the decode steps' syncs per step over the whole step, and over its launch side alone
(the schedule and launch phases: what the overlap loop runs while the previous step computes),
with the source lines that synced. Prefill steps are not counted. The overlap loop's launch side
must have none (`tests/test_overlap_no_sync.py`); its whole step may wait once, on the previous
step's `copy_done` event, which the debug mode does not count. Exits 1 when the overlap loop's
launch side synced. Random weights of a shape from model_shapes.py (`--load-format dummy`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import warnings
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from model_shapes import write_shape_folder  # noqa: E402

from radixengine.managers.io_struct import TokenizedGenerateReqInput  # noqa: E402
from radixengine.managers.scheduler import Scheduler  # noqa: E402
from radixengine.managers.scheduler_io import InProcessIO  # noqa: E402
from radixengine.model_executor.tp_worker import TpModelWorker  # noqa: E402
from radixengine.sampling.sampling_params import SamplingParams  # noqa: E402
from radixengine.server_args import ServerArgs  # noqa: E402

LAUNCH_SIDE = ("schedule", "launch")


class SyncCounter:
    """The sync warnings of the current step, all of them and those of its launch side."""

    def __init__(self) -> None:
        self.step: list[str] = []
        self.launch_side: list[str] = []
        self._in_launch_side = False

    def watch(self, sched: Scheduler) -> None:
        phase = sched.timer.phase

        @contextmanager
        def counted(name: str):
            outer = self._in_launch_side
            self._in_launch_side = outer or name in LAUNCH_SIDE
            try:
                with phase(name):
                    yield
            finally:
                self._in_launch_side = outer

        sched.timer.phase = counted
        warnings.showwarning = self._show

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return
        where = f"{Path(filename).relative_to(REPO) if filename.startswith(str(REPO)) else filename}:{lineno}"
        self.step.append(where)
        if self._in_launch_side:
            self.launch_side.append(where)


def run_loop(worker: TpModelWorker, model_args: dict, args, overlap: bool, vocab: int) -> dict:
    req_pool, allocator = worker.get_memory_pool()
    req_pool.clear()
    allocator.clear()
    sched = Scheduler(
        ServerArgs(**model_args, disable_overlap_schedule=not overlap, chunked_prefill_size=-1),
        tp_worker=worker,
        io=InProcessIO(),
    )
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature, ignore_eos=True)
    sched.io.put(
        *(
            TokenizedGenerateReqInput(
                f"r{i}", None, [rng.randrange(3, vocab) for _ in range(args.prompt_len)], params
            )
            for i in range(args.bs)
        )
    )
    counter = SyncCounter()
    counter.watch(sched)
    per_step, launch_side, sources = [], [], Counter()
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for _ in range(10_000):
            counter.step.clear()
            counter.launch_side.clear()
            sched.process_input_requests(sched.recv_requests(block=False))
            batch = sched.run_step()
            if batch is None and sched.is_idle():
                break
            if batch is not None and batch.forward_mode.is_decode():
                per_step.append(len(counter.step))
                launch_side.append(len(counter.launch_side))
                sources.update(counter.step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    sched.close()
    steps = max(len(per_step), 1)
    return {
        "loop": "overlap" if overlap else "normal",
        "decode_steps": len(per_step),
        "syncs_per_step": sum(per_step) / steps,
        "launch_side_syncs_per_step": sum(launch_side) / steps,
        "max_launch_side_syncs": max(launch_side, default=0),
        "sources": dict(sources.most_common(12)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a shape of model_shapes.py")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.device != "cuda" or not torch.cuda.is_available():
        raise SystemExit("count_syncs: needs a CUDA device (the sync debug mode is CUDA's)")
    with tempfile.TemporaryDirectory() as tmp:
        model_args = dict(
            model_path=write_shape_folder(args.model, Path(tmp), max_position_embeddings=2048),
            load_format="dummy",
            device=args.device,
            dtype=args.dtype,
            max_total_tokens=args.bs * (args.prompt_len + args.new_tokens) * 2 + 1024,
            max_running_requests=args.bs,
        )
        worker = TpModelWorker(ServerArgs(**model_args))
        vocab = worker.get_worker_info().vocab_size
        rows = [run_loop(worker, model_args, args, overlap, vocab) for overlap in (False, True)]
    print(f"{'loop':<8} {'decode steps':>12} {'syncs/step':>10} {'launch side/step':>16}")
    for r in rows:
        print(
            f"{r['loop']:<8} {r['decode_steps']:>12} {r['syncs_per_step']:>10.2f} "
            f"{r['launch_side_syncs_per_step']:>16.2f}"
        )
        for where, n in r["sources"].items():
            print(f"    {n:>5}  {where}")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "bs": args.bs, "rows": rows}, indent=2))
    overlap = rows[1]
    sys.exit(1 if overlap["max_launch_side_syncs"] > 0 else 0)


if __name__ == "__main__":
    main()
