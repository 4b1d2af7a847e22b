"""Run Flower on a listening socket `gpufleet up` bound and passed down.

`python -m tasks.operator.flower_socket FD celery-arguments...` runs `celery celery-arguments...`
(`-A tasks.app flower ...`) with Flower serving on the inherited socket FD instead of
binding its `--port` itself. The launcher binds the port before any child starts, so the
Flower URL it prints is this Flower's, and no other process can take the port in between
(nor while Flower restarts).

Flower 2 binds in `Flower.start_http_server` through `flower.app.bind_sockets` (tornado's);
that one name is replaced here.
"""

from __future__ import annotations

import importlib
import socket
import sys
from typing import Any


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[1].isdigit():
        raise SystemExit(
            "usage: python -m tasks.operator.flower_socket FD -A tasks.app flower [options]"
        )
    sock = socket.socket(fileno=int(argv[1]))
    sock.setblocking(False)  # tornado's IOLoop accepts without blocking
    app: Any = importlib.import_module("flower.app")
    if not callable(getattr(app, "bind_sockets", None)):
        raise SystemExit(
            f"flower {getattr(importlib.import_module('flower'), '__version__', '?')} binds "
            "its port in a way gpufleet does not know; start it with celery flower instead"
        )

    def inherited(*_: Any, **__: Any) -> list[socket.socket]:
        return [sock]

    app.bind_sockets = inherited
    sys.argv = ["celery", *argv[2:]]
    celery: Any = importlib.import_module("celery.__main__")  # what `python -m celery` runs
    celery.main()


if __name__ == "__main__":
    main(sys.argv)
