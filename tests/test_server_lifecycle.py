"""The HTTP server's start and stop as an operator meets them: an address it cannot listen on and a
model it cannot find are one line and exit code 1, before any model loads; SIGTERM to the whole
process group (what systemd and `timeout` send) is a shutdown, not a crash."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import psutil
import pytest
from test_engine_utils import (
    build_tiny_model,
    raw_post,
    read_until,
    subprocess_env,
    wait_gone,
    wait_test_server,
)

from radixengine.utils.network import get_free_port


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_llama")), max_position_embeddings=8192)


def serve(model_path: str, port: int, *flags: str, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "radixengine.launch_server", "--model-path", model_path, "--port", str(port)]
    cmd += ["--dtype", "float32", "--max-total-tokens", "8192", "--num-threads", "1", *flags]
    return subprocess.Popen(cmd, env=subprocess_env(), text=True, **popen)


def test_an_address_in_use_is_refused_before_the_model_loads(model_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = serve(model_path, port, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert err.strip().splitlines() == [
        f"python -m radixengine.launch_server: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ], err
    assert "model loaded" not in out + err


def test_a_missing_model_is_one_line(tmp_path):
    proc = serve(str(tmp_path / "nope"), get_free_port(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert err.strip().splitlines()[-1] == (
        f"python -m radixengine.launch_server: error: --model-path {tmp_path / 'nope'}: no such file or folder"
    ), err
    assert "Traceback" not in err


def test_sigterm_to_the_process_group_is_a_shutdown_not_a_crash(model_path, tmp_path):
    """The children get the signal too and end first: the stream in flight ends with "the server is
    shutting down", the server exits 0, and nothing calls it a crash."""
    log = tmp_path / "server.log"
    port = get_free_port()
    with open(log, "w") as f:
        proc = serve(model_path, port, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    proc.base_url, proc.log = f"http://127.0.0.1:{port}", log
    try:
        wait_test_server(proc)
        kids = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        body = {
            "text": "hello",
            "stream": True,
            "sampling_params": {"max_new_tokens": 8000, "ignore_eos": True},
        }
        sock = raw_post(proc, "/generate", body)
        read_until(sock, b"data: ")  # streaming
        os.killpg(proc.pid, signal.SIGTERM)
        rest = read_until(sock, b"data: [DONE]")
        sock.close()
        assert proc.wait(60) == 0, log.read_text()
        assert b"the server is shutting down" in rest, rest[-500:]
        assert "died unexpectedly" not in log.read_text()
        assert wait_gone(kids) == set()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
