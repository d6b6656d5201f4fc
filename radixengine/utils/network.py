"""Small network helpers: free ports and the ipc:// names of one engine's sockets."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


def get_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def is_port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@dataclass
class PortArgs:
    """The ZMQ endpoints between the three processes (SGLang's names)."""

    # Tokenizer manager binds; scheduler (replies) and detokenizer (BatchStrOut) connect.
    tokenizer_ipc_name: str
    # Scheduler binds; tokenizer manager connects.
    scheduler_input_ipc_name: str
    # Detokenizer binds; scheduler connects.
    detokenizer_ipc_name: str

    @classmethod
    def init_new(cls, ipc_dir: str) -> PortArgs:
        def name(kind: str) -> str:
            return "ipc://" + os.path.join(ipc_dir, kind)

        return cls(name("tokenizer"), name("scheduler"), name("detokenizer"))
