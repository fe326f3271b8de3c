"""Quiver's own HTTP/1.1 server: an ``asyncio.Protocol`` on httptools that runs an ASGI app.

Every Quiver HTTP listener (the v2 API, SageMaker, metrics, each ``--http-workers`` process)
runs its ASGI app on this server. It does what uvicorn did for them, at a fraction of the CPU
per request:

- one connection parses with one ``httptools.HttpRequestParser``; a request's scope is built
  once its head is complete, and its app task starts once the bytes at hand are parsed, so a
  small request's whole body is usually there on the app's first ``receive()`` (no event, no
  wait);
- the response head is held until the first body message, then head and body leave in ONE
  ``transport.write`` (one syscall, one packet, one wake-up of the client); a body sent in
  parts (``more_body``) without a ``content-length`` goes out chunked (server-sent events);
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
import http
import logging
import socket
from typing import Any
from urllib.parse import unquote

import httptools
import orjson

from quiver import messages

logger = logging.getLogger("quiver.http")

#: Triton's kMaxChunkedChunks: a chunked request body of more non-empty chunks is refused.
MAX_CHUNKS = 1 << 16
#: The request line and headers of one request, together; more is answered 431.
MAX_HEAD_BYTES = 256 * 1024
#: A connection with no request in progress that sent nothing for this long is closed.
KEEP_ALIVE_SECONDS = 5.0
#: Request body bytes held for an app that has not read them yet before reading pauses.
HIGH_WATER = 1 << 20
#: Requests parsed ahead of the one being answered (pipelining) before reading pauses.
PIPELINE_DEPTH = 16

_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in http.HTTPStatus}
_DISCONNECT = {"type": "http.disconnect"}
_ASGI = {"version": "3.0", "spec_version": "2.3"}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LAST_CHUNK = b"0\r\n\r\n"
_NO_BODY_STATUSES = frozenset((204, 304))
_FRAMING = frozenset((b"content-length", b"connection", b"transfer-encoding"))
#: A response body up to this size is copied behind its head to leave in one write.
COPY_LIMIT = 256 * 1024


def _plain(status: int, text: str, *, close: bool = True) -> bytes:
    body = text.encode()
    head = _STATUS_LINES[status] + b"content-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n" % len(body)
    return head + (b"connection: close\r\n\r\n" if close else b"\r\n") + body


_SERVER_ERROR = _plain(500, "Internal Server Error")


class _Request:
    """One request and its response: the ASGI ``receive`` and ``send`` of one app call."""

    __slots__ = (
        "body_done",
        "body_given",
        "buffered",
        "chunked",
        "conn",
        "disconnected",
        "done",
        "expect_continue",
        "head_sent",
        "headers",
        "is_head",
        "keep_alive",
        "length",
        "parts",
        "scope",
        "sent",
        "started",
        "status",
        "waiter",
    )

    def __init__(self, conn: HttpProtocol, scope: dict[str, Any], keep_alive: bool, expect_continue: bool) -> None:
        self.conn = conn
        self.scope = scope
        self.parts: list[bytes] = []
        self.buffered = 0
        self.body_done = False  # the parser has seen the whole body
        self.body_given = False  # the app has been given the last of it
        self.waiter: asyncio.Future[None] | None = None
        self.expect_continue = expect_continue
        self.keep_alive = keep_alive
        self.is_head = scope["method"] == "HEAD"
        self.started = False
        self.status = 200
        self.headers: Any = ()
        self.head_sent = False
        self.chunked = False
        self.done = False  # the response is complete
        self.disconnected = False
        self.length: int | None = None  # the content-length the app declared
        self.sent = 0

    # -- what the parser and the connection tell the request -----------------------------

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def feed(self, body: bytes) -> None:
        if self.done or self.disconnected:
            return  # answered already: the rest of the body is read and dropped
        self.parts.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER:
            self.conn.pause_reading()
        self.wake()

    def disconnect(self) -> None:
        self.disconnected = True
        self.wake()

    # -- ASGI ----------------------------------------------------------------------------

    async def receive(self) -> dict[str, Any]:
        if self.expect_continue:
            self.expect_continue = False
            if not self.started and not self.body_done and not self.disconnected:
                self.conn.transport.write(_CONTINUE)
        while True:
            if self.disconnected or self.done:
                return _DISCONNECT
            if self.parts or (self.body_done and not self.body_given):
                parts = self.parts
                body = parts[0] if len(parts) == 1 else b"".join(parts)
                self.parts = []
                if self.buffered > HIGH_WATER:
                    self.conn.resume_reading()
                self.buffered = 0
                more = not self.body_done
                if not more:
                    self.body_given = True
                return {"type": "http.request", "body": body, "more_body": more}
            # nothing to give: the next part of the body, or (all read) a disconnect
            self.conn.resume_reading()
            waiter = self.waiter = self.conn.loop.create_future()
            await waiter

    async def send(self, message: dict[str, Any]) -> None:
        if self.disconnected:
            return
        conn = self.conn
        kind = message["type"]
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("the response has started already")
            self.started = True
            self.status = message["status"]
            self.headers = message.get("headers", ())
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        if not self.started:
            raise RuntimeError("'http.response.body' before 'http.response.start'")
        if self.done:
            raise RuntimeError("the response is complete already")
        body: bytes = message.get("body", b"")
        more: bool = message.get("more_body", False)
        if not self.head_sent:
            self.head_sent = True
            head = self._head(more, len(body))
            if self.is_head or self.status in _NO_BODY_STATUSES:
                conn.transport.write(head)
                body = b""
            elif self.chunked:
                conn.transport.write(b"".join((head, b"%x\r\n" % len(body), body, b"\r\n", b"" if more else _LAST_CHUNK)) if body else head + (b"" if more else _LAST_CHUNK))
            else:
                _write(conn.transport, head, body)
        elif self.is_head or self.status in _NO_BODY_STATUSES:
            body = b""
        elif self.chunked:
            if body:
                conn.transport.write(b"".join((b"%x\r\n" % len(body), body, b"\r\n", b"" if more else _LAST_CHUNK)))
            elif not more:
                conn.transport.write(_LAST_CHUNK)
        elif body:
            conn.transport.write(body)
        self.sent += len(body)
        if more:
            if conn.write_paused is not None:
                await conn.write_paused
            return
        if self.length is not None and self.sent != self.length and not self.is_head and self.status not in _NO_BODY_STATUSES:
            self.keep_alive = False  # the framing is broken: the connection cannot go on
            conn.transport.close()
            raise RuntimeError(f"the response declared {self.length} bytes of content but sent {self.sent}")
        self.done = True
        self.wake()
        conn.response_done(self)

    def _head(self, more: bool, first: int) -> bytes:
        status = self.status
        lines = [_STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status]
        count = 1
        close = False
        for name, value in self.headers:
            lower = name.lower()
            if lower in _FRAMING:
                if lower == b"content-length":
                    self.length = int(value)
                elif lower == b"connection":
                    close = value.lower() == b"close"
                else:
                    self.chunked = b"chunked" in value.lower()
            lines += (name, b": ", value, b"\r\n")
            count += 1
        if close:
            self.keep_alive = False
        elif not self.keep_alive:
            lines.append(b"connection: close\r\n")
            count += 1
        if self.length is None and not self.chunked and status not in _NO_BODY_STATUSES and not self.is_head:
            count += 1
            if more:
                self.chunked = True
                lines.append(b"transfer-encoding: chunked\r\n")
            else:
                lines.append(b"content-length: %d\r\n" % first)
                self.length = first
        lines.append(b"\r\n")
        head = b"".join(lines)
        if head.count(b"\n") != count + 1:  # a header that would split the head: never sent
            self.keep_alive = False
            raise RuntimeError("invalid character in a response header")
        return head

    def respond(self, status: int, headers: bytes, payload: bytes) -> None:
        """The whole response at once (the ``quiver.respond`` extension): ``headers`` the
        header lines (each ending in CRLF; no content-length, no connection) built by Quiver
        from trusted values. Head and payload leave in one write."""
        if self.disconnected:
            return
        if self.started:
            raise RuntimeError("the response has started already")
        self.started = self.head_sent = True
        self.status = status
        conn = self.conn
        size = len(payload)
        head = b"".join((
            _STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status,
            headers,
            b"content-length: %d\r\n\r\n" % size if self.keep_alive else b"content-length: %d\r\nconnection: close\r\n\r\n" % size,
        ))
        _write(conn.transport, head, b"" if self.is_head else payload)
        self.done = True
        if self.waiter is not None:
            self.wake()
        conn.response_done(self)


def _write(transport: asyncio.Transport, head: bytes, body: bytes) -> None:
    """``head`` then ``body``: one write (one syscall) unless the body is large enough that
    copying it costs more than a second write."""
    if len(body) > COPY_LIMIT:
        transport.write(head)
        transport.write(body)
    else:
        transport.write(head + body if body else head)


class HttpProtocol(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.app = server.app
        self.loop = server.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set by connection_made
        self.current: _Request | None = None  # the request being answered
        self.parsing: _Request | None = None  # the request whose body is being parsed
        self.pipeline: collections.deque[_Request] = collections.deque()
        self.pending: _Request | None = None  # parsed head, task not started yet
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
        for request in (self.current, self.parsing, *self.pipeline):
            if request is not None:
                request.disconnect()
        self.pipeline.clear()
        self.pending = None
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
        except httptools.HttpParserError:
            self._refuse(_plain(400, "Invalid HTTP request received."))
            return
        pending = self.pending
        if pending is not None:
            self.pending = None
            self._start(pending)

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
        if self.reading_paused and len(self.pipeline) < PIPELINE_DEPTH:
            self.reading_paused = False
            if not self.transport.is_closing():
                self.transport.resume_reading()

    # -- httptools callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []
        self.head_bytes = 0
        self.chunks = 0
        self.expect_continue = False

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
        parser = self.parser
        version = parser.get_http_version()
        raw_path = self.url
        query = b""
        if b"?" in raw_path or b"%" in raw_path or raw_path[:1] != b"/":
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
            "method": parser.get_method().decode("ascii"),
            "root_path": "",
            "path": path,
            "raw_path": raw_path,
            "query_string": query,
            "headers": self.headers,
        }
        keep_alive = version != "1.0" and parser.should_keep_alive() and not self.server.stopping
        request = _Request(self, scope, keep_alive, self.expect_continue and version == "1.1")
        scope["extensions"] = {"quiver.respond": request.respond}
        self.parsing = request
        if self.current is None and self.pending is None:
            self.pending = request  # started once the bytes at hand are parsed
        else:
            self.pipeline.append(request)
            if len(self.pipeline) >= PIPELINE_DEPTH:
                self.pause_reading()

    def on_chunk_header(self) -> None:  # every chunk, the last (empty) one too
        self.chunks += 1

    def on_body(self, body: bytes) -> None:
        if self.refused:
            return
        if self.chunks > MAX_CHUNKS:
            payload = orjson.dumps({"error": messages.too_many_chunks(MAX_CHUNKS)})
            self._refuse(
                _STATUS_LINES[400]
                + b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(payload)
                + payload
            )
            return
        request = self.parsing
        if request is not None:
            request.feed(body)

    def on_message_complete(self) -> None:
        request = self.parsing
        if request is None or self.refused:
            return
        self.parsing = None
        request.body_done = True
        request.wake()

    # -- requests and responses ---------------------------------------------------------

    def _start(self, request: _Request) -> None:
        self.current = request
        task = self.loop.create_task(self._run(request))
        self.server.tasks.add(task)
        task.add_done_callback(self.server.tasks.discard)

    async def _run(self, request: _Request) -> None:
        try:
            await self.app(request.scope, request.receive, request.send)
        except BaseException as exc:
            if not request.disconnected:
                logger.error("exception in the HTTP application", exc_info=exc)
                if not request.started:
                    self._answer_failure(request)
                elif not request.done:
                    self.transport.close()
            if isinstance(exc, asyncio.CancelledError | KeyboardInterrupt | SystemExit):
                raise
        else:
            if request.disconnected:
                return
            if not request.started:
                logger.error("the HTTP application returned without starting a response")
                self._answer_failure(request)
            elif not request.done:
                logger.error("the HTTP application returned without completing its response")
                self.transport.close()

    def _answer_failure(self, request: _Request) -> None:
        request.started = request.done = True
        request.keep_alive = False
        self.transport.write(_SERVER_ERROR)
        self.response_done(request)

    def response_done(self, request: _Request) -> None:
        """The answer to the current request is complete: close, or go on with the next."""
        if request is not self.current:
            return
        self.current = None
        self.last_active = self.loop.time()
        transport = self.transport
        if (
            not request.keep_alive
            or (request.expect_continue and not request.body_done)  # it would not send the body
            or (self.refused and not self.pipeline)
        ):
            self.pipeline.clear()
            transport.close()
            return
        if transport.is_closing():
            return
        if self.pipeline:
            self._start(self.pipeline.popleft())
        if self.reading_paused and (self.current is None or self.current.buffered <= HIGH_WATER):
            self.resume_reading()

    def _refuse_head(self) -> None:
        self._refuse(_plain(431, "Request header fields too large."))

    def _refuse(self, answer: bytes) -> None:
        """Answer ``answer`` and close: the rest of what this connection sends is not read.
        A request being answered sees a client that went away; its answer goes nowhere."""
        if self.refused:
            return
        self.refused = True
        for request in (self.current, self.parsing, *self.pipeline):
            if request is not None:
                request.disconnect()
        self.pipeline.clear()
        self.pending = None
        if not self.transport.is_closing():
            self.transport.pause_reading()
            self.transport.write(answer)
            self.transport.close()

    def shutdown(self) -> None:
        """The server stops: close if idle, else after the answer in progress."""
        if self.current is None and self.pending is None:
            self.transport.close()
            return
        for request in (self.current, self.pending):
            if request is not None:
                request.keep_alive = False


class HttpServer:
    """Serves one ASGI app on sockets bound by the caller. Set :attr:`should_exit` to stop
    (from the loop's thread); :meth:`serve` then returns once in-flight requests finished or
    ``graceful_seconds`` passed."""

    def __init__(self, app: Any, *, graceful_seconds: float = 30.0) -> None:
        self.app = app
        self.graceful_seconds = graceful_seconds
        self.connections: set[HttpProtocol] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.started = False
        self.stopping = False
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
                if conn.current is None and conn.pending is None and conn.last_active < horizon:
                    conn.transport.close()

    async def _shutdown(self) -> None:
        self.stopping = True
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.shutdown()
        try:
            async with asyncio.timeout(self.graceful_seconds):
                while self.connections or self.tasks:
                    await asyncio.sleep(0.05)
        except TimeoutError:
            logger.error("cancelling %d request(s) still running after the %g s grace period",
                         len(self.tasks), self.graceful_seconds)
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
