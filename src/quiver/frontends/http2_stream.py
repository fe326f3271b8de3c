"""A stream of Quiver's HTTP/2 server connection (:mod:`quiver.frontends.http2`): its state, the
handler it is given to, and the sending half of the connection (:class:`StreamWriter`): header
blocks, DATA under both of the client's flow-control windows in frames no larger than the
client's ``MAX_FRAME_SIZE``, trailers after the last byte, stream resets, and the credit given
back to the client: for the connection as DATA arrives (``discard``; streams' windows bound
what each holds), for a stream as its handler wants more (``top_up``: its window back to
:data:`STREAM_WINDOW` once it took what came, or enough for a whole message the server has
made room for)."""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING, Any, Protocol

from quiver.frontends import http2_frames as h2
from quiver.frontends.http2_frames import ConnectionError as H2ConnectionError
from quiver.frontends.http2_frames import StreamError

logger = logging.getLogger(__name__)

#: The flow-control windows this server grants: each stream (SETTINGS_INITIAL_WINDOW_SIZE; what a
#: stream may send before its handler makes room) and the whole connection.
STREAM_WINDOW = 65535
CONNECTION_WINDOW = 1 << 20
#: A writer waits (:meth:`StreamWriter.writable`) while its stream holds more unsent bytes.
WRITE_HIGH_WATER = 256 * 1024
#: Streams reset by this server whose late frames are ignored rather than refused.
RESET_MEMORY = 256


class StreamHandler(Protocol):
    """What a stream's handler (a gRPC call) is told."""

    def data_received(self, data: memoryview, end_stream: bool) -> None:
        """Bytes of the stream (the view is valid during the call only); ``end_stream``: the
        client has sent all. The handler calls :meth:`StreamWriter.top_up` when it wants more."""

    def stream_reset(self, code: int) -> bool:
        """The stream is gone (the client reset it, the connection closed, a stream error, or
        its answer stalled); True while its work goes on, in which case the handler calls
        :meth:`StreamWriter.stream_done` once it has ended."""


class Stream:
    """One stream's state on this connection."""

    __slots__ = ("blocked_since", "drained", "handler", "id", "local_closed", "pending", "pending_bytes",
                 "recv_window", "remote_closed", "reset", "send_window", "trailers")

    def __init__(self, stream_id: int, send_window: int, recv_window: int) -> None:
        self.id = stream_id
        self.handler: StreamHandler | None = None
        self.send_window = send_window
        self.recv_window = recv_window
        self.remote_closed = False
        self.local_closed = False
        self.reset = False
        self.pending: collections.deque[memoryview] = collections.deque()  # DATA waiting for window
        self.pending_bytes = 0
        self.blocked_since: float | None = None  # since when its data waits for window
        self.trailers: bytes | None = None  # framed trailers, sent once pending is empty
        self.drained: asyncio.Future[None] | None = None  # a writer waiting for room


class StreamWriter:
    """The sending half of :class:`~quiver.frontends.http2.Http2Connection`."""

    loop: asyncio.AbstractEventLoop
    transport: Any
    peer: str
    closed: bool
    streams: dict[int, Stream]
    last_stream_id: int
    owner: Any  # its Http2Owner: pending_send is also counted there, for all connections
    pending_send: int  # bytes of DATA waiting for the client's windows, on every stream
    _out: list[bytes]
    _receiving: bool
    _flush_soon: bool
    _blocked: dict[int, Stream]
    _send_window: int
    _recv_window: int
    _recv_unacked: int
    _peer_max_frame: int
    _table_update: bool
    _write_paused: bool
    _reset_ids: collections.deque[int]
    _zombies: int
    _idle_since: float | None

    if TYPE_CHECKING:  # the connection's and the guard's (quiver.frontends.http2, http2_guard)

        def _maybe_close(self) -> None: ...

        def _flush_out(self) -> None: ...

        def _sent_stream_data(self) -> None: ...

        def _induced_frame(self) -> bool: ...

    # -- sending ----------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        """Frames go out in the order they were made, in one write per read processed (what
        answering it made) or per turn of the event loop (what calls finishing in that turn
        sent): fewer system calls and wake-ups of the client. A connection with one stream
        writes at once."""
        if self.closed:
            return
        if not self._receiving and not self._flush_soon and len(self.streams) <= 1:
            self.transport.write(data)  # nothing else could finish in this turn: no need to wait
            return
        self._out.append(data)
        if not self._receiving and not self._flush_soon:
            self._flush_soon = True
            self.loop.call_soon(self._flush_out)

    def _block_of(self, block: bytes) -> bytes:
        if self._table_update:
            self._table_update = False
            return h2.TABLE_SIZE_ZERO + block
        return block

    def respond(self, stream: Stream, headers: bytes, body: bytes, trailers: bytes) -> None:
        """A whole answer: the header block, the body as DATA, the trailer block (END_STREAM);
        in one write when the windows allow."""
        if stream.reset or stream.local_closed or self.closed:
            return
        size = len(body)
        limit = self._peer_max_frame
        if (
            stream.pending or size > stream.send_window or size > self._send_window
            or size > limit or len(headers) > limit or len(trailers) > limit or self._table_update
        ):
            self.send_headers(stream, headers)
            self.send_data(stream, body)
            self.send_trailers(stream, trailers)
            return
        stream.send_window -= size
        self._send_window -= size
        self._sent_stream_data()
        sid = stream.id
        self._write(
            h2.frame(h2.HEADERS, h2.END_HEADERS, sid, headers)
            + h2.data_frame_header(sid, size) + body
            + h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, sid, trailers)
        )
        self._local_close(stream)

    def send_headers(self, stream: Stream, block: bytes, end_stream: bool = False) -> None:
        """The response's header block (``end_stream``: a trailers-only answer)."""
        if stream.reset or stream.local_closed or self.closed:
            return
        self._sent_stream_data()
        self._write(h2.headers_frames(stream.id, self._block_of(block), end_stream, self._peer_max_frame))
        if end_stream:
            self._local_close(stream)

    def send_data(self, stream: Stream, data: bytes | memoryview) -> None:
        """Body bytes, sent as the windows allow (the rest waits for WINDOW_UPDATE)."""
        if stream.reset or stream.local_closed or self.closed or not data:
            return
        stream.pending.append(memoryview(data))
        stream.pending_bytes += len(data)
        self.pending_send += len(data)
        self.owner.pending_send += len(data)
        self._flush_stream(stream)

    def send_trailers(self, stream: Stream, block: bytes) -> None:
        """The trailer block, with END_STREAM, once every byte before it has been sent."""
        if stream.reset or stream.local_closed or self.closed or stream.trailers is not None:
            return
        stream.trailers = block
        self._flush_stream(stream)

    def _flush_stream(self, stream: Stream) -> None:
        pending = stream.pending
        limit = self._peer_max_frame
        sent = 0
        while pending:
            window = min(stream.send_window, self._send_window)
            if window <= 0:
                self._blocked[stream.id] = stream
                if stream.blocked_since is None:
                    stream.blocked_since = self.loop.time()
                break
            chunk = pending[0]
            size = min(len(chunk), window, limit)
            if size == len(chunk):
                pending.popleft()
            else:
                pending[0] = chunk[size:]
                chunk = chunk[:size]
            stream.send_window -= size
            self._send_window -= size
            stream.pending_bytes -= size
            self._write(h2.data_frame_header(stream.id, size) + bytes(chunk))
            sent += size
        if sent:
            self.pending_send -= sent
            self.owner.pending_send -= sent
            self._sent_stream_data()
            if pending:
                stream.blocked_since = self.loop.time()  # progress: the stall clock starts again
        if not pending:
            self._blocked.pop(stream.id, None)
            stream.blocked_since = None
            if stream.trailers is not None:
                block, stream.trailers = stream.trailers, None
                self._write(h2.headers_frames(stream.id, self._block_of(block), True, limit))
                self._local_close(stream)
        if stream.pending_bytes <= WRITE_HIGH_WATER and not self._write_paused:
            self._wake(stream)

    def _flush_blocked(self) -> None:
        for stream in list(self._blocked.values()):
            if self._send_window <= 0:
                break
            self._flush_stream(stream)

    async def writable(self, stream: Stream) -> None:
        """Until ``stream`` has room for more (few bytes waiting for window, the transport
        not paused) or has ended."""
        while not stream.reset and not self.closed and (stream.pending_bytes > WRITE_HIGH_WATER or self._write_paused):
            if stream.drained is None or stream.drained.done():
                stream.drained = self.loop.create_future()
            await stream.drained

    def _wake(self, stream: Stream) -> None:
        waiter = stream.drained
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- credit -------------------------------------------------------------------------------

    def top_up(self, stream: Stream, target: int = STREAM_WINDOW) -> None:
        """Let the client send up to ``target`` more bytes on ``stream``: a WINDOW_UPDATE when
        its window is a quarter or more short of a stream window, or short at all of another
        target (what a message being received still needs: the client cannot finish it without)."""
        if stream.remote_closed or stream.reset:
            return
        short = min(target, h2.MAX_WINDOW) - stream.recv_window
        if short > 0 and (short >= STREAM_WINDOW // 4 or target != STREAM_WINDOW):
            self._write(h2.window_update(stream.id, short))
            stream.recv_window += short

    def discard(self, size: int) -> None:
        """``size`` received bytes nobody holds: the connection's window gets them back."""
        self._recv_unacked += size
        if self._recv_unacked >= CONNECTION_WINDOW // 4:
            self._write(h2.window_update(0, self._recv_unacked))
            self._recv_window += self._recv_unacked
            self._recv_unacked = 0

    # -- a stream's end -------------------------------------------------------------------------

    def reset_stream(self, stream: Stream, code: int = h2.CANCEL) -> None:
        """End ``stream`` with RST_STREAM (its handler is not told: it asked)."""
        if stream.reset or self.closed:
            return
        stream.reset = True
        self._reset_ids.append(stream.id)
        self._write(h2.rst_stream(stream.id, code))
        self._forget(stream)

    def _local_close(self, stream: Stream) -> None:
        stream.local_closed = True
        if stream.remote_closed:
            self._forget(stream)
        else:
            # The answer is complete before the request: the client may stop sending.
            self.reset_stream(stream, h2.NO_ERROR)

    def _forget(self, stream: Stream) -> None:
        self.streams.pop(stream.id, None)
        if self._blocked.pop(stream.id, None) is not None or stream.pending_bytes:
            self.pending_send -= stream.pending_bytes
            self.owner.pending_send -= stream.pending_bytes
            stream.pending.clear()
            stream.pending_bytes = 0
        self._wake(stream)
        if not self.streams:
            self._idle_since = self.loop.time()
            if not self.closed:
                self.owner.connection_idle(self)
        self._maybe_close()

    def _gone(self, stream: Stream, code: int) -> None:
        """Tell ``stream``'s handler it has ended (the stream is out of :attr:`streams`)."""
        stream.reset = True
        self._wake(stream)
        handler, stream.handler = stream.handler, None
        if handler is not None and handler.stream_reset(code):
            self._zombies += 1  # its work goes on: it counts against the stream limit until done

    def stream_done(self) -> None:
        """A handler told of its stream's end has finished its work."""
        self._zombies -= 1
        if not self._zombies and not self.streams and not self.closed:
            self.owner.connection_idle(self)

    def _stall_reset(self, stream: Stream) -> None:
        """A stream whose answer waited too long for window: reset, and what it holds freed."""
        self.reset_stream(stream, h2.CANCEL)
        self._gone(stream, h2.CANCEL)

    def _stream_error(self, exc: StreamError) -> None:
        if exc.stream_id > self.last_stream_id:  # no RST_STREAM on an idle stream (RFC 9113 5.1)
            raise H2ConnectionError(exc.code, exc.message)
        logger.debug("gRPC client %s: stream %d reset: %s", self.peer, exc.stream_id, exc.message)
        if not self._induced_frame():
            return
        stream = self.streams.get(exc.stream_id)
        if stream is None:
            self._reset_ids.append(exc.stream_id)
            self._write(h2.rst_stream(exc.stream_id, exc.code))
            return
        self.reset_stream(stream, exc.code)
        self._gone(stream, exc.code)


__all__ = [
    "CONNECTION_WINDOW", "RESET_MEMORY", "STREAM_WINDOW", "WRITE_HIGH_WATER", "Stream", "StreamHandler", "StreamWriter",
]
