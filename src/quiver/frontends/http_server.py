"""Quiver's own HTTP/1.1 server: an ``asyncio.Protocol`` on httptools that runs an ASGI app.

Every Quiver HTTP listener (the v2 API, SageMaker, metrics, each ``--http-workers`` process)
runs its ASGI app on this server. It does what uvicorn did for them, at a fraction of the CPU
per request:

- one connection parses with one ``httptools.HttpRequestParser``; a request's scope is built
  once its head is complete, and the connection's one runner task (not a task per request)
  calls the app once the bytes at hand are parsed, so a small request's whole body is usually
  there on the app's first ``receive()`` (no event, no wait);
- the response head is held until the first body message, then head and body leave in ONE
  ``transport.write`` (one syscall, one packet, one wake-up of the client); a body sent in
  parts (``more_body``) without a ``content-length`` goes out chunked (server-sent events);
  the scope's ``quiver.respond`` extension answers in one call, with no ASGI messages, and
  its ``quiver.body`` extension gives a body that is all here in one call, with no
  ``receive()`` (the v2 inference route uses both);
- HTTP/1.1 keep-alive and pipelining (answers in order, reading paused while requests wait),
  HTTP/1.0 (the connection closes after the answer), ``Transfer-Encoding: chunked`` request
  bodies (more than :data:`MAX_CHUNKS` chunks refused as Triton does), ``Expect:
  100-continue`` (the 100 goes out when the app first reads the body), a request head past
  :data:`MAX_HEAD_BYTES` refused with 431, a malformed request answered 400 before the
  connection closes, a client that goes away seen by the app as ``http.disconnect``, idle
  connections closed after :data:`KEEP_ALIVE_SECONDS`, and a graceful stop: no new
  connections, idle ones closed, busy ones closed after their answer, what is left after the
  grace period cancelled.

The app sees the ASGI 3 HTTP interface (``scope``, ``receive``, ``send``), so every route,
the Ray path's direct ASGI calls and the tests' expectations stay as they were.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import httptools
import orjson

from quiver import messages
from quiver.frontends.http_exchange import HIGH_WATER, SERVER_ERROR, STATUS_LINES, Exchange, plain

logger = logging.getLogger(__name__)

#: Triton's kMaxChunkedChunks: a chunked request body of more non-empty chunks is refused.
MAX_CHUNKS = 1 << 16
#: The request line and headers of one request, together; more is answered 431.
MAX_HEAD_BYTES = 256 * 1024
#: A connection with no request in progress that sent nothing for this long is closed.
KEEP_ALIVE_SECONDS = 5.0
#: Requests parsed ahead of the one being answered (pipelining) before reading pauses.
PIPELINE_DEPTH = 16

_ASGI = {"version": "3.0", "spec_version": "2.3"}
_METHODS = {m.encode(): m for m in ("GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH")}


class HttpProtocol(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.app = server.app
        self.loop = server.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set by connection_made
        self.current: Exchange | None = None  # the request the app is answering
        self.parsing: Exchange | None = None  # the request whose body is being parsed
        self.queue: collections.deque[Exchange] = collections.deque()  # parsed, waiting their turn
        self.runner: asyncio.Task[None] | None = None  # runs the app for one request after another
        self.idle: asyncio.Future[None] | None = None  # what the runner waits on between requests
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0
        self.chunks = 0
        self.expect_continue = False
        self.refused = False
        self.reading_paused = False
        self.write_paused: asyncio.Future[None] | None = None
        self.last_active = 0.0
        self.server_address: Any = None
        self.client_address: Any = None
        self.on_request = server.on_request

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass
        self.server.connections.add(self)
        self.last_active = self.loop.time()
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            self.server_address = tuple(sock.getsockname()[:2])
            peer = transport.get_extra_info("peername")
            self.client_address = tuple(peer[:2]) if peer else None

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        for request in (self.current, self.parsing, *self.queue):
            if request is not None:
                request.disconnect()
        self.queue.clear()
        self._wake_runner()
        if self.write_paused is not None and not self.write_paused.done():
            self.write_paused.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.last_active = self.loop.time()
        if self.refused:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No protocol to upgrade to: the request is answered as any other, and is the last
            # one this connection reads (what follows its head is not HTTP/1.1).
            self.refused = True
            for request in (self.current, *self.queue):
                if request is not None:
                    request.keep_alive = False
        except httptools.HttpParserError:
            self._refuse(plain(400, "Invalid HTTP request received."))
            return
        if self.current is None and self.queue:
            self._next()

    def pause_writing(self) -> None:
        self.write_paused = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.write_paused is not None:
            if not self.write_paused.done():
                self.write_paused.set_result(None)
            self.write_paused = None

    def pause_reading(self) -> None:
        if not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.reading_paused and len(self.queue) < PIPELINE_DEPTH:
            self.reading_paused = False
            if not self.transport.is_closing():
                self.transport.resume_reading()

    # -- httptools callbacks ------------------------------------------------------------

    # (no on_message_begin: what a request head gathers is reset once it is complete)

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.head_bytes += len(url)
        if self.head_bytes > MAX_HEAD_BYTES:
            self._refuse_head()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_bytes += len(name) + len(value) + 4
        if self.head_bytes > MAX_HEAD_BYTES:
            self._refuse_head()
            return
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.refused:
            return
        if self.on_request is not None:
            self.on_request()
        parser = self.parser
        version = parser.get_http_version()
        method = parser.get_method()
        raw_path = self.url
        query = b""
        # find(), not ``in``: bytes' ``in`` tries the operand as an integer first (a TypeError
        # raised and cleared each time)
        if raw_path.find(b"?") >= 0 or raw_path.find(b"%") >= 0 or raw_path[:1] != b"/":
            url = httptools.parse_url(raw_path)  # raises HttpParserInvalidURLError: a 400
            raw_path, query = url.path, url.query or b""
        path = raw_path.decode("ascii")
        if "%" in path:
            path = unquote(path)
        scope = {
            "type": "http",
            "asgi": _ASGI,
            "http_version": version,
            "server": self.server_address,
            "client": self.client_address,
            "scheme": "http",
            "method": _METHODS.get(method) or method.decode("ascii"),
            "root_path": "",
            "path": path,
            "raw_path": raw_path,
            "query_string": query,
            "headers": self.headers,
        }
        keep_alive = version != "1.0" and parser.should_keep_alive() and not self.server.stopping
        request = Exchange(self, scope, keep_alive, self.expect_continue and version == "1.1")
        scope["extensions"] = {"quiver.respond": request.respond, "quiver.body": request.body_now}
        self.url = b""
        self.headers = []
        self.head_bytes = self.chunks = 0
        self.expect_continue = False
        self.parsing = request
        self.queue.append(request)  # served once the bytes at hand are parsed (data_received)
        if len(self.queue) >= PIPELINE_DEPTH:
            self.pause_reading()

    def on_chunk_header(self) -> None:  # every chunk, the last (empty) one too
        self.chunks += 1

    def on_body(self, body: bytes) -> None:
        if self.refused:
            return
        if self.chunks > MAX_CHUNKS:
            payload = orjson.dumps({"error": messages.too_many_chunks(MAX_CHUNKS)})
            self._refuse(
                STATUS_LINES[400]
                + b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(payload)
                + payload
            )
            return
        request = self.parsing
        if request is not None:
            if request.done or request.disconnected:
                return  # answered already: the rest of the body is read and dropped
            request.parts.append(body)
            request.buffered += len(body)
            if request.buffered > HIGH_WATER:
                self.pause_reading()
            if request.waiter is not None:
                request.wake()

    def on_message_complete(self) -> None:
        request = self.parsing
        if request is None or self.refused:
            return
        self.parsing = None
        request.body_done = True
        request.wake()

    # -- requests and responses ---------------------------------------------------------

    def _next(self) -> None:
        """Hand the next queued request to the runner: a task per connection, not per
        request, that waits between requests on a future."""
        self.current = self.queue.popleft()
        if self.runner is None:
            self.runner = runner = self.loop.create_task(self._serve())
            self.server.tasks.add(runner)
            runner.add_done_callback(self.server.tasks.discard)
        else:
            self._wake_runner()

    def _wake_runner(self) -> None:
        idle = self.idle
        if idle is not None:
            self.idle = None
            if not idle.done():
                idle.set_result(None)

    async def _serve(self) -> None:
        try:
            while (request := self.current) is not None:
                await self._call(request)
                self.current = None
                if self.transport.is_closing():
                    return
                if self.queue:
                    self.current = self.queue.popleft()
                    continue
                self.idle = self.loop.create_future()
                await self.idle  # set: a request to serve (current), or the connection is gone
        finally:
            self.runner = None

    async def _call(self, request: Exchange) -> None:
        try:
            await self.app(request.scope, request.receive, request.send)
        except BaseException as exc:
            if not request.disconnected:
                logger.error("exception in the HTTP application", exc_info=exc)
                if not request.head_sent:  # nothing written yet: a 500 can still go out
                    self._answer_failure(request)
                elif not request.done:
                    self.transport.close()
            if isinstance(exc, asyncio.CancelledError | KeyboardInterrupt | SystemExit):
                raise
        else:
            if request.disconnected:
                return
            if not request.head_sent:
                logger.error("the HTTP application returned without sending a response")
                self._answer_failure(request)
            elif not request.done:
                logger.error("the HTTP application returned without completing its response")
                self.transport.close()

    def _answer_failure(self, request: Exchange) -> None:
        request.started = request.head_sent = request.done = True
        request.keep_alive = False
        self.transport.write(SERVER_ERROR)
        self.response_done(request)

    def response_done(self, request: Exchange) -> None:
        """The answer to ``request`` is complete: close, or read on (the runner serves the
        next request once the app has returned)."""
        self.last_active = self.loop.time()
        transport = self.transport
        if (
            not request.keep_alive
            or (request.expect_continue and not request.body_done)  # it would not send the body
            or (self.refused and not self.queue)
        ):
            self.queue.clear()
            transport.close()
            return
        if self.reading_paused and not transport.is_closing():
            waiting = self.queue[0] if self.queue else None
            if waiting is None or waiting.buffered <= HIGH_WATER:
                self.resume_reading()

    def _refuse_head(self) -> None:
        self._refuse(plain(431, "Request header fields too large."))

    def _refuse(self, answer: bytes) -> None:
        """Answer ``answer`` and close: the rest of what this connection sends is not read.
        A request being answered sees a client that went away; its answer goes nowhere."""
        if self.refused:
            return
        self.refused = True
        for request in (self.current, self.parsing, *self.queue):
            if request is not None:
                request.disconnect()
        self.queue.clear()
        if not self.transport.is_closing():
            self.transport.pause_reading()
            self.transport.write(answer)
            self.transport.close()

    def shutdown(self) -> None:
        """The server stops: close if idle, else after the answer in progress."""
        if self.current is None and not self.queue:
            self.transport.close()
            return
        for request in (self.current, *self.queue):
            if request is not None:
                request.keep_alive = False


class HttpServer:
    """Serves one ASGI app on sockets bound by the caller. Set :attr:`should_exit` to stop
    (from the loop's thread); :meth:`serve` then returns once in-flight requests finished or
    ``graceful_seconds`` passed. ``on_request``: called as each request's head is complete,
    before the app runs (the model side's idle detector: ``InferenceService.request_came``)."""

    def __init__(self, app: Any, *, graceful_seconds: float = 30.0, on_request: Callable[[], None] | None = None) -> None:
        self.app = app
        self.graceful_seconds = graceful_seconds
        self.on_request = on_request
        self.connections: set[HttpProtocol] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.started = False
        self.stopping = False
        #: Set (with should_exit) to stop without waiting for in-flight requests.
        self.force_exit = False
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set by serve
        self._exit: asyncio.Event | None = None
        self._servers: list[asyncio.AbstractServer] = []

    @property
    def should_exit(self) -> bool:
        return self.stopping

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value and self._exit is not None:
            self._exit.set()
        self.stopping = self.stopping or value

    async def serve(self, sockets: list[socket.socket]) -> None:
        self.loop = asyncio.get_running_loop()
        self._exit = asyncio.Event()
        if self.stopping:
            return
        for sock in sockets:
            self._servers.append(await self.loop.create_server(lambda: HttpProtocol(self), sock=sock, backlog=2048))
        self.started = True
        sweeper = asyncio.create_task(self._close_idle())
        try:
            await self._exit.wait()
        finally:
            sweeper.cancel()
            await self._shutdown()

    async def _close_idle(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            horizon = self.loop.time() - KEEP_ALIVE_SECONDS
            for conn in list(self.connections):
                if conn.current is None and not conn.queue and conn.last_active < horizon:
                    conn.transport.close()

    async def _shutdown(self) -> None:
        self.stopping = True
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.shutdown()
        if not self.force_exit:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.graceful_seconds):
                    while (self.connections or self.tasks) and not self.force_exit:
                        await asyncio.sleep(0.05)
        if self.tasks:
            logger.error("cancelling %d request(s) still running (%s)", len(self.tasks),
                         "forced stop" if self.force_exit else f"past the {self.graceful_seconds:g} s grace period")
            for task in list(self.tasks):
                task.cancel()
        for conn in list(self.connections):
            conn.transport.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                while self.tasks:
                    await asyncio.sleep(0.05)
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1.0)


__all__ = ["KEEP_ALIVE_SECONDS", "MAX_CHUNKS", "MAX_HEAD_BYTES", "HttpServer"]
