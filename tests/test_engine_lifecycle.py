"""The Engine's processes: a killed scheduler gives a clear error (not a hang) and no orphan;
shutdown() fails the calls in flight at once; shutdown() and garbage collection leave no child
process behind."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from test_engine_utils import build_tiny_model, subprocess_env, wait_gone

from radixengine import Engine
from radixengine.engine import EngineDeadError

ARGS = {"dtype": "float32", "max_total_tokens": 4096, "num_threads": 1, "log_level": "error"}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_llama")))


def engine_children(engine: Engine) -> dict[str, int]:
    return {name: proc.pid for name, proc in engine.tokenizer_manager.processes}


def engine_pids() -> set[int]:
    """Our child processes, without multiprocessing's shared resource tracker."""
    kids = psutil.Process().children(recursive=True)
    return {p.pid for p in kids if "resource_tracker" not in " ".join(_cmdline(p))}


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def test_garbage_collected_engine_leaves_no_child(model_path):
    before = engine_pids()
    engine = Engine(model_path=model_path, **ARGS)
    assert engine.generate("hello", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
    children = set(engine_children(engine).values())
    assert children <= engine_pids() - before
    del engine
    gc.collect()
    assert wait_gone(children) == set()


def test_killed_scheduler_raises_instead_of_hanging(model_path):
    engine = Engine(model_path=model_path, **ARGS)
    pids = engine_children(engine)
    stream = engine.generate("hello", {"max_new_tokens": 1000, "ignore_eos": True}, stream=True)
    next(stream)
    os.kill(pids["scheduler"], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="scheduler process .* died"):
        for _ in stream:
            pass
    assert time.monotonic() - start < 10
    with pytest.raises(EngineDeadError):  # and every later call
        engine.generate("hello")
    engine.shutdown()
    assert wait_gone(set(pids.values())) == set()
    engine.shutdown()  # idempotent


PARENT_SCRIPT = """
import sys, time
from radixengine import Engine
if __name__ == "__main__":
    engine = Engine(model_path=sys.argv[1], dtype="float32", max_total_tokens=4096, num_threads=1, log_level="error")
    print(" ".join(str(p.pid) for _, p in engine.tokenizer_manager.processes), flush=True)
    time.sleep(600)
"""


def test_children_exit_when_the_parent_is_killed(model_path, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT_SCRIPT)
    parent = subprocess.Popen(
        [sys.executable, str(script), model_path], stdout=subprocess.PIPE, text=True, env=subprocess_env()
    )
    try:
        children = {int(p) for p in parent.stdout.readline().split()}
        assert len(children) == 2 and wait_gone(children, timeout=0.5) == children
    finally:
        parent.kill()
        parent.wait()
    assert wait_gone(children, timeout=10) == set()


def test_shutdown_fails_the_calls_in_flight_at_once(model_path):
    """generate() in a thread, an async_generate awaiter and a stream, all waiting on a scheduler
    that cannot answer (stopped): shutdown() ends each with EngineDeadError, at once."""
    engine = Engine(model_path=model_path, **ARGS)
    scheduler = engine_children(engine)["scheduler"]
    params = {"max_new_tokens": 8}
    results: dict[str, BaseException | object] = {}

    def call(name: str, fn) -> threading.Thread:
        def run() -> None:
            try:
                results[name] = fn()
            except BaseException as e:
                results[name] = e

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    async def awaiter():
        return await engine.async_generate("hello", params, rid="awaited")

    os.kill(scheduler, signal.SIGSTOP)
    try:
        threads = [
            call("generate", lambda: engine.generate("hello", params, rid="blocked")),
            call("async_generate", lambda: asyncio.run(awaiter())),
            call("stream", lambda: list(engine.generate("hello", params, stream=True, rid="streamed"))),
        ]
        deadline = time.monotonic() + 30
        while not {"blocked", "awaited", "streamed"} <= set(engine.tokenizer_manager.rid_to_state):
            assert time.monotonic() < deadline, "the calls did not reach the tokenizer manager"
            time.sleep(0.01)
        closer = call("shutdown", engine.shutdown)
        for thread in threads:
            thread.join(10)
            assert not thread.is_alive(), "a call still waits after shutdown()"
    finally:
        with contextlib.suppress(ProcessLookupError):  # shutdown() may have ended it already
            os.kill(scheduler, signal.SIGCONT)
    closer.join(30)
    for name in ("generate", "async_generate", "stream"):
        assert isinstance(results[name], EngineDeadError), (name, results[name])
        assert "shut down" in str(results[name])
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate("hello", params)
    assert wait_gone({scheduler}) == set()


UNGUARDED_SCRIPT = """
import sys
from radixengine import Engine
Engine(model_path=sys.argv[1], dtype="float32", max_total_tokens=4096, num_threads=1, log_level="error")
"""


def test_an_engine_started_at_import_time_says_how_to_fix_it(model_path, tmp_path):
    """The children are spawned and re-import the main module: a script without the
    `__main__` guard gets an error that says so, not a bare 'exited'."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), model_path],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert done.returncode != 0
    assert "failed to start" in done.stderr and 'if __name__ == "__main__":' in done.stderr


PIPED_SCRIPT = """
import sys
from radixengine import Engine
if __name__ == "__main__":
    with Engine(model_path=sys.argv[1], dtype="float32", max_total_tokens=4096, num_threads=1, log_level="error") as e:
        out = e.generate("hello", {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
    print("generated", len(out["output_ids"]))
"""


def test_an_engine_started_from_a_script_piped_on_stdin_works(model_path):
    """`python - < script.py`: the main module's __file__ is '<stdin>', which the spawned children
    cannot re-import; they start as under `python -c`, without it."""
    done = subprocess.run(
        [sys.executable, "-", model_path],
        input=PIPED_SCRIPT,
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["generated", "3"]
