"""One HTTP request and its response on Quiver's HTTP server (``http_server.py``): the ASGI
``receive`` and ``send`` of one app call, the ``quiver.body`` extension that gives a body all
here at once, and the ``quiver.respond`` extension that answers at once. The response head is
held until the first body message so that head and body leave in one ``transport.write``."""

from __future__ import annotations

import asyncio
import http
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quiver.frontends.http_server import HttpProtocol

#: Request body bytes held for an app that has not read them yet before reading pauses.
HIGH_WATER = 1 << 20
#: A response body up to this size is copied behind its head to leave in one write.
COPY_LIMIT = 256 * 1024

STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in http.HTTPStatus}
_DISCONNECT = {"type": "http.disconnect"}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LAST_CHUNK = b"0\r\n\r\n"
_NO_BODY_STATUSES = frozenset((204, 304))
_FRAMING = frozenset((b"content-length", b"connection", b"transfer-encoding"))


def plain(status: int, text: str, *, close: bool = True) -> bytes:
    body = text.encode()
    head = STATUS_LINES[status] + b"content-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n" % len(body)
    return head + (b"connection: close\r\n\r\n" if close else b"\r\n") + body


SERVER_ERROR = plain(500, "Internal Server Error")


class Exchange:
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
        "reading",
        "scope",
        "sent",
        "started",
        "status",
        "waiter",
    )

    status: int
    headers: Any
    chunked: bool
    length: int | None
    sent: int

    def __init__(self, conn: HttpProtocol, scope: dict[str, Any], keep_alive: bool, expect_continue: bool) -> None:
        self.conn = conn
        self.scope = scope
        self.parts: list[bytes] = []
        self.buffered = 0
        self.body_done = False  # the parser has seen the whole body
        self.body_given = False  # the app has been given the last of it
        self.reading = False  # the app has asked for the body
        self.waiter: asyncio.Future[None] | None = None
        self.expect_continue = expect_continue
        self.keep_alive = keep_alive
        self.is_head = scope["method"] == "HEAD"
        self.started = False
        self.head_sent = False
        self.done = False  # the response is complete
        self.disconnected = False
        # status, headers, chunked, length (the content-length the app declared) and sent are
        # set when the response starts

    # -- what the parser and the connection tell the request -----------------------------

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def disconnect(self) -> None:
        self.disconnected = True
        self.wake()

    # -- ASGI ----------------------------------------------------------------------------

    def body_now(self) -> bytes | None:
        """The whole body when the parser has all of it and the app has asked for none of it
        yet (the ``quiver.body`` extension: no ASGI message, no coroutine); else None, and
        the app reads it with ``receive``."""
        if self.reading or not self.body_done or self.disconnected or self.done:
            return None
        self.reading = self.body_given = True
        self.expect_continue = False  # the body is here: nothing to ask the client for
        parts = self.parts
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        self.parts = []
        if self.buffered > HIGH_WATER:
            self.conn.resume_reading()
        self.buffered = 0
        return body

    async def receive(self) -> dict[str, Any]:
        self.reading = True
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
            self.chunked = False
            self.length = None
            self.sent = 0
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
            head = self._head(more, len(body))
            self.head_sent = True
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
        lines = [STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status]
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
        if self.length is None and not self.chunked and status not in _NO_BODY_STATUSES:
            if not more:  # the whole body is here (for HEAD: the body GET would get)
                count += 1
                lines.append(b"content-length: %d\r\n" % first)
                self.length = first
            elif not self.is_head:
                count += 1
                self.chunked = True
                lines.append(b"transfer-encoding: chunked\r\n")
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
            STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status,
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


__all__ = ["COPY_LIMIT", "HIGH_WATER", "SERVER_ERROR", "STATUS_LINES", "Exchange", "plain"]
