"""Running an ASGI app on a socket we bound, the way every Quiver HTTP listener runs one
(the v2 API, SageMaker, metrics): uvicorn with httptools, no access log, no proxy or
Server/Date headers, and no signal handling of its own (the runner owns the signals)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn


class AsgiServer(uvicorn.Server):
    """uvicorn without its own signal handling: the runner owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(app: Any, sock: socket.socket, *, graceful_seconds: float) -> tuple[AsgiServer, asyncio.Task[None]]:
    """Serve ``app`` on ``sock`` and return once it accepts connections. Stop it with
    ``server.should_exit = True`` then ``await task`` (in-flight requests finish within
    ``graceful_seconds``). If it stops while starting, the task's exception is raised."""
    config = uvicorn.Config(
        app,
        interface="asgi3",
        log_config=None,
        log_level="warning",
        access_log=False,
        lifespan="off",
        http="httptools",
        proxy_headers=False,
        server_header=False,
        date_header=False,
        timeout_graceful_shutdown=int(graceful_seconds),
    )
    server = AsgiServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        task.result()  # raises what stopped it
        raise OSError("the listener stopped while starting")
    return server, task
