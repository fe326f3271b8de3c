"""Running an ASGI app on a socket we bound, the way every Quiver HTTP listener runs one
(the v2 API, SageMaker, metrics, the ``--http-workers`` processes): on Quiver's own HTTP/1.1
server (:mod:`quiver.frontends.http_server`), with no access log, no Server/Date headers and
no signal handling of its own (the runner owns the signals)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

from quiver.frontends.http_server import MAX_CHUNKS, HttpServer

#: The server :func:`serve` returns (stop it with ``should_exit = True``).
AsgiServer = HttpServer


async def serve(
    app: Any, sock: socket.socket, *, graceful_seconds: float, on_request: Callable[[], None] | None = None
) -> tuple[AsgiServer, asyncio.Task[None]]:
    """Serve ``app`` on ``sock`` and return once it accepts connections. Stop it with
    ``server.should_exit = True`` then ``await task`` (in-flight requests finish within
    ``graceful_seconds``). If it stops while starting, the task's exception is raised.
    ``on_request``: called as each request arrives (see :class:`HttpServer`)."""
    server = HttpServer(app, graceful_seconds=graceful_seconds, on_request=on_request)
    task = asyncio.create_task(server.serve([sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0)
    if task.done():
        task.result()  # raises what stopped it
        raise OSError("the listener stopped while starting")
    return server, task


__all__ = ["MAX_CHUNKS", "AsgiServer", "serve"]
