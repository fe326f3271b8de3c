"""One gRPC call on Quiver's own server: a stream's handler and the servicer's context.

A :class:`GrpcCall` reads the stream's length-prefixed messages (one for a unary request,
any number for a streaming one; a message may span many DATA frames and a frame hold many
messages), runs the method's handler in a task, and answers: response headers, messages and
trailers with ``grpc-status`` and ``grpc-message`` (percent-encoded), or trailers alone for
an error before any message. To the handler it is the context ``grpc.aio`` gives one
(``invocation_metadata``, ``abort``, ``read``, ``write``, ``set_code``, ``set_details``,
``set_trailing_metadata``, ``send_initial_metadata``, ``peer``, ``time_remaining``,
``cancelled``, ``done``, ``add_done_callback``, ``auth_context``), so Quiver's servicers and
``grpc_health``'s run on it unchanged.

As grpcio does: messages compressed with ``grpc-encoding`` gzip or deflate are inflated
(under the size limit), responses of the methods the server compresses go out gzip'd to
clients that accept it, a message past ``--grpc-max-message-size`` either way is
RESOURCE_EXHAUSTED with grpcio's words, ``grpc-timeout`` sets the call's deadline (then
DEADLINE_EXCEEDED, and the handler is cancelled), and a client that resets the stream or
goes away cancels the handler's task.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import logging
import zlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc

from quiver.frontends import http2_frames as h2
from quiver.frontends.grpc_receive import PROGRESS_SECONDS, RequestBuffer
from quiver.frontends.offload import INFLATE_INLINE_BYTES, in_worker

if TYPE_CHECKING:
    from quiver.frontends.grpc_server import GrpcServer, RequestHead, RpcMethod
    from quiver.frontends.http2 import Http2Connection, Stream

logger = logging.getLogger(__name__)

#: Responses compressed on a codec thread from this size on (zlib lets go of the GIL); requests
#: inflate there from offload.INFLATE_INLINE_BYTES on.
THREAD_CODEC_BYTES = 256 * 1024
#: gRPC's levels (low, medium, high) as zlib's.
ZLIB_LEVELS = {1: 1, 2: 6, 3: 9}

_RESPONSE_HEAD = ((b":status", b"200"), (b"content-type", b"application/grpc"),
                  (b"grpc-accept-encoding", b"identity,deflate,gzip"))
#: The response headers and the trailers of a call that went well, encoded once.
HEADERS = h2.header_block(_RESPONSE_HEAD)
HEADERS_GZIP = h2.header_block((*_RESPONSE_HEAD, (b"grpc-encoding", b"gzip")))
TRAILERS_OK = h2.header_block(((b"grpc-status", b"0"),))
_PREFIX = 5  # a message's compressed flag and 4-byte length


def percent_encoded(details: str) -> bytes:
    """``grpc-message``: UTF-8, with bytes outside printable ASCII and ``%`` as ``%XX``."""
    raw = details.encode("utf-8", "replace")
    if details.isascii() and details.isprintable() and "%" not in details:
        return raw
    return b"".join(bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in raw)


def metadata_fields(metadata: Any) -> list[tuple[bytes, bytes]]:
    """Call metadata as header fields (``-bin`` values base64, unpadded as gRPC emits them)."""
    fields = []
    for key, value in metadata or ():
        name = str(key).lower().encode("ascii")
        if name.endswith(b"-bin"):
            raw = value if isinstance(value, bytes) else str(value).encode("utf-8")
            fields.append((name, base64.b64encode(raw).rstrip(b"=")))
        else:
            fields.append((name, value if isinstance(value, bytes) else str(value).encode("latin-1", "replace")))
    return fields


def _inflate(data: bytes, encoding: str, limit: int) -> bytes:
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
    try:
        out = inflater.decompress(data, limit + 1)
        if len(out) > limit or inflater.unconsumed_tail:
            raise CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"Received message larger than max (more than {limit} bytes when inflated vs. {limit})")
        out += inflater.flush()
    except zlib.error as exc:
        raise CallFailed(grpc.StatusCode.INTERNAL, f"Failed to decompress a {encoding} message: {exc}") from None
    if not inflater.eof:
        raise CallFailed(grpc.StatusCode.INTERNAL, f"Failed to decompress a {encoding} message: truncated")
    return out


class CallFailed(Exception):
    """The call ends with this status (raised where there is no context to abort, e.g. by a
    method's request parser)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class GrpcCall:
    """One RPC (see the module's docstring)."""

    def __init__(self, server: GrpcServer, connection: Http2Connection, stream: Stream, head: RequestHead) -> None:
        self.server = server
        self.connection = connection
        self.stream = stream
        self.head = head
        self.method: RpcMethod = head.method  # type: ignore[assignment]  # a call has one
        self.loop = connection.loop
        server.calls += 1  # (out again in _complete)
        self._request: RequestBuffer | None = None  # what was received and not yet taken
        self._message: tuple[int, bytes] | None = None  # a unary request: (flag, bytes)
        self._received = 0.0  # when bytes last came (a message with bytes missing must progress)
        self._progress: asyncio.TimerHandle | None = None
        self._zombie = False  # the stream is gone, the handler still works
        self._reader: asyncio.Future[None] | None = None
        self._ended = False  # the client has sent all
        self._task: asyncio.Task[None] | None = None
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._trailing: tuple[tuple[str, Any], ...] = ()
        self._initial: tuple[tuple[str, Any], ...] = ()
        self._headers_sent = False
        self._aborted = False
        self._cancelled = False
        self._done = False
        self._callbacks: list[Callable[[Any], None]] = []
        self._gzip = bool(self.method.compressed and server.compression_level and head.accepts_gzip)
        if head.timeout is not None:
            self._deadline = self.loop.time() + head.timeout
            self._timer = self.loop.call_at(self._deadline, self._expire)
        if self.method.request_streaming:
            self._start()

    # -- the stream (http2.StreamHandler) ---------------------------------------------------

    def data_received(self, data: memoryview, end_stream: bool) -> None:
        connection, stream = self.connection, self.stream
        if self._done:
            return
        limit = self.server.max_receive_message_size
        request = self._request
        if request is None:
            size = len(data)
            if end_stream and size >= _PREFIX and not self.method.request_streaming:
                length = int.from_bytes(data[1:5], "big")
                if _PREFIX + length == size and length <= limit:  # a whole unary request at once
                    self._ended = True
                    if self._flag_ok(data[0]):
                        self._message = (data[0], bytes(data[_PREFIX:]))
                        self._start()
                    return
            request = self._request = RequestBuffer(self.server.budget, connection, stream)
        if data:
            if not request.add(data):
                self._no_room()
                return
            self._received = self.loop.time()
        head = request.head()
        if head is not None and head[1] > limit:
            self._finish(grpc.StatusCode.RESOURCE_EXHAUSTED, f"Received message larger than max ({head[1]} vs. {limit})")
            return
        if self.method.request_streaming:
            request.credit()
            self._ended = end_stream
            self._wake_reader()
        elif head is not None and request.pending() > _PREFIX + head[1]:
            self._finish(grpc.StatusCode.INTERNAL, f"more than one request message for unary method {self.method.name}")
            return
        elif end_stream:
            self._ended = True
            if not request.whole():
                gone = "carried no message" if not request.pending() else "ended inside a message"
                self._finish(grpc.StatusCode.INTERNAL, f"the request {gone}")
                return
            flag, message = request.take()
            if self._flag_ok(flag):
                self._message = (flag, message)
                self._start()
            return
        else:
            request.credit()
        if request.pending() and not request.whole() and self._progress is None:
            self._progress = self.loop.call_later(PROGRESS_SECONDS, self._check_progress)

    def _flag_ok(self, flag: int) -> bool:
        if flag > 1:
            self._finish(grpc.StatusCode.INTERNAL, f"invalid message flags {flag:#x}")
            return False
        if flag and self.head.encoding == "identity":
            self._finish(grpc.StatusCode.INTERNAL, "a compressed message without grpc-encoding")
            return False
        return True

    def _check_progress(self) -> None:
        self._progress = None
        request = self._request
        if self._done or request is None or not request.pending() or request.whole():
            return
        idle = self.loop.time() - self._received
        if idle < PROGRESS_SECONDS:
            self._progress = self.loop.call_later(PROGRESS_SECONDS - idle, self._check_progress)
            return
        self._cancelled = True
        self._finish(grpc.StatusCode.UNAVAILABLE,
                     f"the request message stalled: no bytes for {PROGRESS_SECONDS:.0f} s with {request.pending()} held")
        if self._task is not None:
            self._task.cancel()

    def _no_room(self) -> None:
        """The server's receive budget has no room for this call's bytes: a call that has not
        started is refused (REFUSED_STREAM: nothing of it ran, the client may send it again),
        one that has ends RESOURCE_EXHAUSTED."""
        self._cancelled = True
        if self._task is None:
            self.connection.reset_stream(self.stream, h2.REFUSED_STREAM)
            self._complete()
            return
        budget = self.server.budget
        self._finish(grpc.StatusCode.RESOURCE_EXHAUSTED,
                     f"the server's request buffers are full ({budget.used} of {budget.limit} bytes held)")
        self._task.cancel()

    def stream_reset(self, code: int) -> bool:
        """The client reset the stream or went away: the handler is cancelled; True while
        its task still runs (it tells the connection when it has ended)."""
        if self._done:
            return False
        self._cancelled = True
        self._complete()
        task = self._task
        if task is None or task.done():
            return False
        task.cancel()
        self._zombie = True
        return True

    def _ended_work(self) -> None:
        if self._zombie:
            self._zombie = False
            self.connection.stream_done()

    # -- running the handler ------------------------------------------------------------

    def _start(self) -> None:
        self._task = self.loop.create_task(self._unary() if self.method.unary else self._run())

    async def _unary(self) -> None:
        """A unary-unary call (the common one, kept short)."""
        method = self.method
        server = self.server
        server.calls_started()
        try:
            flag, data = self._message  # type: ignore[misc]
            self._message = None  # the handler has it now
            if flag:
                data = await self._inflated(data)
            response = await method.handler(data if method.parse is None else method.parse(data), self)
            if response is None:
                raise CallFailed(self._code or grpc.StatusCode.UNKNOWN, self._details or "the method returned no response")
            if method.serialize is not None:
                response = method.serialize(response)
            size = len(response)
            if size > server.max_send_message_size:
                raise CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"Sent message larger than max ({size} vs. {server.max_send_message_size})")
            if self._done:
                return
            headers = HEADERS_GZIP if self._gzip else HEADERS
            compressed = await self._compressed(response) if self._gzip and size else None
            if compressed is not None:
                body = b"\x01" + len(compressed).to_bytes(4, "big") + compressed
            else:
                body = b"\x00" + size.to_bytes(4, "big") + response
            if self._initial:
                headers = h2.header_block((*_RESPONSE_HEAD, *((b"grpc-encoding", b"gzip"),)[: self._gzip],
                                           *metadata_fields(self._initial)))
            if self._code is None and not self._trailing:
                trailers = TRAILERS_OK
            else:
                trailers = self._trailers(self._code or grpc.StatusCode.OK, self._details)
            self._headers_sent = True
            self.connection.respond(self.stream, headers, body, trailers)
            self._complete()
        except (Exception, asyncio.CancelledError) as exc:
            self._failed(exc)
        finally:
            server.calls_ended()
            self._ended_work()

    async def _run(self) -> None:
        """A call with a streaming request or response."""
        method = self.method
        generator: Any = None
        try:
            request: Any
            if method.request_streaming:
                request = self._requests()
            else:
                flag, data = self._message  # type: ignore[misc]
                self._message = None
                if flag:
                    data = await self._inflated(data)
                request = data if method.parse is None else method.parse(data)
            result = method.handler(request, self)
            if not method.response_streaming:
                await self.write(await result)
            elif hasattr(result, "__anext__"):
                generator = result
                async for item in generator:
                    if self._done:
                        break
                    await self.write(item)
            else:
                await result  # writes with context.write
            self._finish(self._code or grpc.StatusCode.OK, self._details)
        except (Exception, asyncio.CancelledError) as exc:
            self._failed(exc)
        finally:
            try:
                if generator is not None:
                    await generator.aclose()
            finally:
                self._ended_work()

    async def _inflated(self, data: bytes) -> bytes:
        encoding, limit = self.head.encoding, self.server.max_receive_message_size
        if len(data) >= INFLATE_INLINE_BYTES:
            return await in_worker(_inflate, data, encoding, limit)
        return _inflate(data, encoding, limit)

    async def _compressed(self, data: bytes) -> bytes | None:
        """``data`` gzip'd, or ``None`` when that is no smaller (the message goes as it is,
        its flag says so, as grpcio does)."""
        level = ZLIB_LEVELS.get(self.server.compression_level, 6)
        if len(data) >= THREAD_CODEC_BYTES:
            compressed = await in_worker(gzip.compress, data, level, mtime=0)
        else:
            compressed = gzip.compress(data, level, mtime=0)
        return compressed if len(compressed) < len(data) else None

    def _failed(self, exc: BaseException) -> None:
        """The call's end when its handler raised: an abort keeps the status it set, a
        CallFailed carries its own, a cancellation is CANCELLED, anything else UNKNOWN."""
        if isinstance(exc, grpc.aio.AbortError):
            self._finish(self._code or grpc.StatusCode.UNKNOWN, self._details)
        elif isinstance(exc, CallFailed):
            self._finish(exc.code, exc.details)
        elif isinstance(exc, asyncio.CancelledError):
            self._finish(grpc.StatusCode.CANCELLED, "Cancelled")
        else:
            self._unexpected(exc)

    def _unexpected(self, exc: BaseException) -> None:
        logger.error("gRPC %s failed unexpectedly", self.method.name, exc_info=exc)
        code = self._code if self._code not in (None, grpc.StatusCode.OK) else grpc.StatusCode.UNKNOWN
        self._finish(code, self._details or f"Unexpected {type(exc)}: {exc}")

    def _expire(self) -> None:
        self._timer = None
        if not self._done:
            self._cancelled = True
            self._finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            if self._task is not None:
                self._task.cancel()

    # -- answering ------------------------------------------------------------------------

    def _trailers(self, code: grpc.StatusCode, details: str) -> bytes:
        fields = [(b"grpc-status", str(code.value[0]).encode())]
        if details:
            fields.append((b"grpc-message", percent_encoded(details)))
        fields += metadata_fields(self._trailing)
        return h2.header_block(fields)

    def _finish(self, code: grpc.StatusCode, details: str) -> None:
        """End the call with this status (trailers, or trailers only before any message)."""
        if self._done:
            return
        if self._headers_sent:
            self.connection.send_trailers(self.stream, self._trailers(code, details))
        else:
            self._headers_sent = True
            head = h2.header_block((*_RESPONSE_HEAD, *metadata_fields(self._initial)))
            self.connection.send_headers(self.stream, head + self._trailers(code, details), end_stream=True)
        self._complete()

    def _complete(self) -> None:
        if self._done:
            return
        self._done = True
        self.server.calls -= 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._progress is not None:
            self._progress.cancel()
            self._progress = None
        if self._request is not None:
            self._request.release()
            self._request = None
        self._wake_reader()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback(self)
            except Exception:
                logger.exception("a done callback of gRPC %s failed", self.method.name)

    async def _send(self, data: bytes) -> None:
        """One response message (the headers first, if not yet sent)."""
        size = len(data)
        if size > self.server.max_send_message_size:
            raise CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"Sent message larger than max ({size} vs. {self.server.max_send_message_size})")
        if self._done:
            raise asyncio.CancelledError()
        compressed = await self._compressed(data) if self._gzip and size else None
        if compressed is not None:
            data, flag = compressed, b"\x01"
        else:
            flag = b"\x00"
        if self._done:
            raise asyncio.CancelledError()
        connection, stream = self.connection, self.stream
        if not self._headers_sent:
            self._headers_sent = True
            head = HEADERS_GZIP if self._gzip else HEADERS
            if self._initial:
                head = h2.header_block((*_RESPONSE_HEAD, *((b"grpc-encoding", b"gzip"),)[: self._gzip],
                                        *metadata_fields(self._initial)))
            connection.send_headers(stream, head)
        connection.send_data(stream, flag + len(data).to_bytes(4, "big") + data)
        await connection.writable(stream)

    # -- reading a streaming request ----------------------------------------------------------

    def _wake_reader(self) -> None:
        reader = self._reader
        if reader is not None and not reader.done():
            reader.set_result(None)

    async def _next(self) -> Any:
        """The next request message, or :data:`grpc.aio.EOF`."""
        if not self.method.request_streaming:
            raise grpc.aio.UsageError("this method's request is not a stream")
        while True:
            request = self._request
            if request is not None and request.whole():
                flag, data = request.take()
                head = request.head()
                limit = self.server.max_receive_message_size
                if head is not None and head[1] > limit:
                    raise CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, f"Received message larger than max ({head[1]} vs. {limit})")
                request.credit()
                if not self._flag_ok(flag):
                    raise CallFailed(self._code or grpc.StatusCode.INTERNAL, self._details)
                if flag:
                    data = await self._inflated(data)
                parse = self.method.parse
                return data if parse is None else parse(data)
            if self._done:
                return grpc.aio.EOF
            if self._ended:
                if request is not None and request.pending():
                    raise CallFailed(grpc.StatusCode.INTERNAL, "the request ended inside a message")
                return grpc.aio.EOF
            self._reader = self.loop.create_future()
            await self._reader

    async def _requests(self) -> AsyncIterator[Any]:
        while (message := await self._next()) is not grpc.aio.EOF:
            yield message

    # -- the servicer's context (grpc.aio.ServicerContext) ---------------------------------------

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self.head.metadata

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        if self._aborted:
            raise grpc.aio.UsageError("Abort already called!")
        self._aborted = True
        self._code, self._details = code, details
        if trailing_metadata:
            self._trailing = tuple(trailing_metadata)
        raise grpc.aio.AbortError()

    async def read(self) -> Any:
        return await self._next()

    async def write(self, message: Any) -> None:
        serialize = self.method.serialize
        await self._send(message if serialize is None else serialize(message))

    async def send_initial_metadata(self, initial_metadata: Any) -> None:
        if self._headers_sent:
            raise grpc.aio.UsageError("initial metadata has been sent already")
        self._initial = tuple(initial_metadata)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def set_details(self, details: str) -> None:
        self._details = details

    def details(self) -> str:
        return self._details

    def set_trailing_metadata(self, trailing_metadata: Any) -> None:
        self._trailing = tuple(trailing_metadata)

    def trailing_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._trailing

    def set_compression(self, compression: grpc.Compression) -> None:
        self._gzip = compression == grpc.Compression.Gzip and self.head.accepts_gzip

    def disable_next_message_compression(self) -> None:
        self._gzip = False

    def peer(self) -> str:
        return self.connection.peer

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - self.loop.time())

    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        return self._done

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        if self._done:
            callback(self)
        else:
            self._callbacks.append(callback)

    def auth_context(self) -> dict[str, list[bytes]]:
        ssl_object = self.connection.transport.get_extra_info("ssl_object")
        if ssl_object is None:
            return {}
        context: dict[str, list[bytes]] = {"transport_security_type": [b"ssl"]}
        certificate = ssl_object.getpeercert()
        if certificate:
            names = [value for rdn in certificate.get("subject", ()) for key, value in rdn if key == "commonName"]
            if names:
                context["x509_common_name"] = [name.encode() for name in names]
        return context


__all__ = ["HEADERS", "TRAILERS_OK", "CallFailed", "GrpcCall", "metadata_fields", "percent_encoded"]
