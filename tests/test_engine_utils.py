"""Helpers shared by the engine, HTTP and detokenizer tests: a tiny random Llama saved as an HF
folder with a real byte-level BPE tokenizer (and a chat template), and the transformers oracle."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Callable
from contextlib import contextmanager

import psutil

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. héllo wörld, 世界 你好 café naïve",
    "hello world this is a test of the tokenizer and of the engine that serves it",
    "Once upon a time there was a small model that answered every question with numbers 0 1 2 3",
]


def build_tokenizer(path: str, vocab_size: int = 400):
    """Train a small byte-level BPE (multi-byte characters outside the corpus split into byte
    tokens) and save it as a transformers tokenizer with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def build_tiny_model(path: str, seed: int = 0, max_position_embeddings: int = 1024) -> str:
    """A random-weight 2-layer Llama with the tokenizer above, saved as an HF folder (fp32)."""
    os.makedirs(path, exist_ok=True)
    tokenizer = build_tokenizer(path)
    special = dict(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    return save_tiny_llama(path, len(tokenizer), seed, max_position_embeddings, **special)


def save_tiny_llama(
    path: str, vocab_size: int, seed: int, max_position_embeddings: int, **special_ids
) -> str:
    """A random-weight 2-layer Llama (fp32, untied, scaled-up LM head) saved into `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        torch_dtype="float32",
        **special_ids,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger logits: greedy choices far from ties
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_greedy(
    model, input_ids: list[list[int]], max_new_tokens: int, eos_id: int | None = None
) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time (no padding effects);
    stops after `eos_id` when given, otherwise runs `max_new_tokens` (EOS not masked)."""
    import torch

    outs = []
    with torch.no_grad():
        for ids in input_ids:
            out = model(torch.tensor([ids]), use_cache=True)
            tokens: list[int] = []
            while True:
                token = int(out.logits[0, -1].argmax())
                tokens.append(token)
                if len(tokens) >= max_new_tokens or token == eos_id:
                    break
                out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
            outs.append(tokens)
    return outs


def load_hf_model(path: str, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def subprocess_env() -> dict[str, str]:
    """The environment for a Python subprocess that imports radixengine from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    return env


def wait_gone(pids: set[int], timeout: float = 10.0) -> set[int]:
    """The pids still alive (zombies count as gone) after waiting up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {p for p in alive if _alive(p)}
        if alive:
            time.sleep(0.1)
    return alive


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def launch_test_server(model_path: str, log_path, args: list[str], timeout: float = 300.0):
    """`python -m radixengine.launch_server` on a free loopback port with `args`, its output in
    `log_path`; returns the process (with `base_url` and `log` set) once /health answers 200."""
    return wait_test_server(start_test_server(model_path, log_path, args), timeout)


def start_test_server(model_path: str, log_path, args: list[str], port: int | None = None):
    """Starts the server (on `port`, or a free loopback port) without waiting for it."""
    import subprocess
    import sys

    from radixengine.utils.network import get_free_port

    port = port or get_free_port()
    cmd = [
        sys.executable,
        "-m",
        "radixengine.launch_server",
        "--model-path",
        model_path,
        "--port",
        str(port),
        *args,
    ]
    with open(log_path, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=subprocess_env())
    proc.base_url, proc.log, proc.port = f"http://127.0.0.1:{port}", log_path, port
    return proc


def wait_test_server(proc, timeout: float = 300.0):
    """Returns `proc` once its /health answers 200; fails with its log if it exits first."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"the server exited:\n{proc.log.read_text()}"
        try:
            if httpx.get(proc.base_url + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"the server did not answer /health:\n{proc.log.read_text()}"
        time.sleep(0.3)


def stop_test_server(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


# Driving a running server -----------------------------------------------------------------------


@contextmanager
def children_paused(server):
    """The server's scheduler and detokenizer stopped (SIGSTOP): requests reach the tokenizer
    manager and wait there, and nothing is generated, until the block ends."""
    kids = [
        p
        for p in psutil.Process(server.pid).children(recursive=True)
        if "resource_tracker" not in _cmdline(p)
    ]
    assert kids
    for p in kids:
        p.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for p in kids:
            p.send_signal(signal.SIGCONT)


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def wait_until(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def raw_post(server, path: str, body: dict, api_key: str | None = None) -> socket.socket:
    """Send a request on a plain socket (the test decides when the client goes away)."""
    data = json.dumps(body).encode()
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: test\r\n{auth}"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    host, port = server.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(head.encode() + data)
    return sock


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    got = b""
    while marker not in got:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection before {marker!r}: {got!r}"
        got += chunk
    return got


def wait_for_idle_accounting(get_info: Callable[[], dict], timeout: float = 20.0) -> dict:
    """`get_info()` (a server's or an Engine's /get_server_info) once nothing runs or waits and
    every KV slot is free, evictable or protected (no leak); fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        info = get_info()
        idle = info["num_running_reqs"] == 0 and info["num_queue_reqs"] == 0
        total = info["available_tokens"] + info["evictable_tokens"] + info["protected_tokens"]
        if idle and total == info["max_total_tokens"]:
            return info
        assert time.monotonic() < deadline, f"not idle or tokens leaked: {info}"
        time.sleep(0.2)
