"""Running an ASGI app on a socket we bound, the way every Quiver HTTP listener runs one
(the v2 API, SageMaker, metrics): uvicorn with httptools, no access log, no proxy or
Server/Date headers, and no signal handling of its own (the runner owns the signals)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from quiver import messages

#: Triton's kMaxChunkedChunks: a chunked request body of more non-empty chunks is refused.
MAX_CHUNKS = 1 << 16


class AsgiServer(uvicorn.Server):
    """uvicorn without its own signal handling: the runner owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ChunkCountingProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol that refuses a ``Transfer-Encoding: chunked`` body of more
    than :data:`MAX_CHUNKS` non-empty chunks as Triton does: 400 with Triton's message, then
    the connection closes (no more of the body is read). Each chunk costs bookkeeping however
    small it is; the body's size is bounded by the listener's input size limit anyway."""

    _chunks = 0
    _refused = False

    def on_headers_complete(self) -> None:
        self._chunks = 0
        super().on_headers_complete()

    def on_chunk_header(self) -> None:  # httptools calls it for every chunk, the last (empty) one too
        self._chunks += 1

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        if self._chunks > MAX_CHUNKS:
            self._refuse()
            return
        super().on_body(body)

    def _refuse(self) -> None:
        self._refused = True
        payload = orjson.dumps({"error": messages.too_many_chunks(MAX_CHUNKS)})
        head = (
            "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n"
        )
        cycle = self.cycle
        if cycle is not None:  # the app sees a client that went away; its answer goes nowhere
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.pause_reading()
        self.transport.write(head.encode() + payload)
        self.transport.close()


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
        http=ChunkCountingProtocol,
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
