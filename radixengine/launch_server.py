"""`python -m radixengine.launch_server [--model-path PATH] [--host --port ...]`: the HTTP server.

With no argument it serves the bundled SmolLM2 model on http://127.0.0.1:30000."""

from __future__ import annotations

import argparse
import sys

from radixengine.model_executor.runtime_support import check_runtime_support
from radixengine.server_args import ServerArgs

PROG = "python -m radixengine.launch_server"


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        server_args = ServerArgs.from_cli_args(args)
        check_runtime_support(server_args)  # a choice this machine cannot run: refused here, with the reason
    except ValueError as e:
        parser.error(str(e))
    return server_args


def main(argv: list[str] | None = None) -> None:
    from radixengine.entrypoints.http_server import ServerStartError, launch_server

    server_args = parse_args(argv)
    if server_args.node_rank > 0:  # tensor parallel over nodes: this node runs its ranks only
        from radixengine.managers.scheduler_ranks import run_tp_node

        run_tp_node(server_args)
        return
    try:
        launch_server(server_args)
    except ServerStartError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main(sys.argv[1:])
