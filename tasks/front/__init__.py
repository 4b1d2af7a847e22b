"""The fleet's HTTP front: OpenAI's API (`/v1/chat/completions`, `/v1/completions`,
`/v1/embeddings`, `/v1/models`) over its Celery calls, and the live placement map
(`/map`, `fleet_map`). `gpufleet up` runs one
(`--api-port`), `gpufleet api` runs one alone against a fleet's Redis; see `server`.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from pathlib import Path

DEFAULT_PORT = 8000
KEY_FILE = "api-keys"  # in a fleet's directory: the digests of its keys (`keys`)


def serve(
    keys: Path, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT, fd: int | None = None
) -> None:
    """Serve the fleet this process's settings name (GPUFLEET_REDIS_URL, a caller's URL, and
    GPUFLEET_MODELS) on `host`:`port`, or on the listening socket `fd` (the launcher's),
    until SIGINT or SIGTERM."""
    import uvicorn

    from placement.server.tenant_users import PASSWORDS
    from tasks import context
    from tasks.front.keys import KeyFile
    from tasks.front.server import Front, build

    _open_files()
    settings = context.settings()
    key_file = KeyFile(keys)
    len(key_file)  # a missing or malformed key file fails here, not on the first request
    passwords = settings.fleet_dir() / PASSWORDS  # a tenant's key signs in as its user
    front = Front(
        context.catalog(),
        key_file,
        settings.result_backend,
        settings.broker_url,
        passwords,
        operator_url=settings.operator_url,
        fleet=settings.fleet,
    )
    config = uvicorn.Config(
        build(front),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
        backlog=4096,
    )
    # The launcher's socket is handed over as a socket, not as uvicorn's `fd`: uvicorn
    # takes an fd for a Unix socket, and asyncio then leaves Nagle's algorithm on for every
    # connection, which held each answer on a kept-alive connection ~40 ms (delayed ACK).
    sockets = [socket.socket(fileno=fd)] if fd is not None else None
    where = f"fd {fd}" if fd is not None else f"http://{host}:{port}/v1"
    logging.getLogger(__name__).info("serving OpenAI's API on %s", where)
    uvicorn.Server(config).run(sockets=sockets)


def _open_files() -> None:
    """Raise this process's open-file limit to its hard limit: each open stream holds a
    socket, and a soft limit of 1,024 would cap the front below what it can hold."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 65536 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
