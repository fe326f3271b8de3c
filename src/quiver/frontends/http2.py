"""One HTTP/2 server connection (RFC 9113) as an ``asyncio.Protocol``, for Quiver's gRPC server.

Frames are parsed here, header blocks decoded with ``hpack``, and what a request is made of is
handed to the connection's owner (:class:`Http2Owner`, the gRPC server) and to each stream's
handler (:class:`StreamHandler`, a gRPC call). What the protocol asks of a server is done here:

- the client's preface and SETTINGS (acknowledged; ``INITIAL_WINDOW_SIZE``,
  ``MAX_FRAME_SIZE`` and ``HEADER_TABLE_SIZE`` applied), this server's own SETTINGS (concurrent
  streams, its stream window, the header list size) and a large connection window;
- flow control both ways: received DATA is charged to the connection's and the stream's
  window (a client past either is a FLOW_CONTROL_ERROR); the connection's is returned as data
  arrives, a stream's as its handler asks (:meth:`Http2Connection.top_up`), so a stream nobody
  reads stops its sender. What is sent waits for both of the client's windows
  and goes out in frames no larger than the client's ``MAX_FRAME_SIZE``; a writer can wait
  until its stream has room (:meth:`Http2Connection.writable`);
- HEADERS with CONTINUATION, padding on DATA and HEADERS, PRIORITY read and ignored, PING
  answered, RST_STREAM (the stream's handler is told), WINDOW_UPDATE, GOAWAY both ways;
- at most ``max_concurrent_streams`` streams at once (more are refused with REFUSED_STREAM,
  which clients retry), malformed requests reset (PROTOCOL_ERROR), and every connection
  error answered with GOAWAY before the connection closes;
- a graceful stop as gRPC servers do it (GOAWAY with the largest stream id and a PING, then
  GOAWAY with the last stream taken once the PING is answered; the streams in progress
  finish); a connection closed whose client takes nothing of what is left to send for
  :data:`CLOSE_STALL_SECONDS`, or has not taken all of it :data:`CLOSE_DEADLINE_SECONDS` after,
  is cut off; keepalive, time limits and flood limits are
  :mod:`quiver.frontends.http2_guard`'s.

What a client can make a connection hold is bounded: header blocks by the header list size
the server announces (a larger one is a connection error, as HPACK must stay in step), the
request bytes its calls have not taken by the windows (credit goes back as they are taken),
and the owner refuses new streams while its budgets are spent (:meth:`Http2Owner.accepting`).
Streams a client resets count against the stream limit until their work has ended, and at
most :data:`NEW_STREAMS_PER_READ` streams open per read before other connections get a turn.

Header blocks a client repeats (a gRPC client sends the same few fields with every call, by
index into its HPACK table) are decoded once: the owner's reading of a block is kept, keyed by
the block's bytes, while decoding leaves the connection's HPACK table as it was, and dropped
the moment a block changes the table.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any, Protocol

import hpack

from quiver.frontends import http2_frames as h2
from quiver.frontends.http2_frames import ConnectionError as H2ConnectionError
from quiver.frontends.http2_frames import StreamError
from quiver.frontends.http2_guard import GOAWAY_PING as _GOAWAY_PING
from quiver.frontends.http2_guard import HEADER_BLOCK_SECONDS, ConnectionGuard, Keepalive
from quiver.frontends.http2_stream import (
    CONNECTION_WINDOW,
    RESET_MEMORY,
    STREAM_WINDOW,
    WRITE_HIGH_WATER,
    Stream,
    StreamHandler,
    StreamWriter,
)

logger = logging.getLogger(__name__)

#: How long the graceful stop waits for the answer to its PING before the final GOAWAY.
GOAWAY_PING_SECONDS = 5.0
#: A connection closed whose client takes nothing of what is left to send for this long is cut off.
CLOSE_STALL_SECONDS = 5.0
#: However its client reads, a connection closed is cut off this long after (asyncio's default
#: ``ssl_shutdown_timeout``, which bounds a TLS connection's close, see the server's listener).
CLOSE_DEADLINE_SECONDS = 30.0
#: Decoded header blocks kept per connection (see the module's docstring), and the largest kept.
HEAD_CACHE_SIZE = 64
HEAD_CACHE_BLOCK = 1024
#: Streams opened per read before the connection lets others have the event loop.
NEW_STREAMS_PER_READ = 64
#: A CONTINUATION frame counts as at least this many bytes against the header block limit.
CONTINUATION_COST = 1024

_HPACK_ERRORS = (hpack.HPACKError, IndexError, ValueError)


class Http2Owner(Protocol):
    """What a connection asks of its server."""

    max_concurrent_streams: int
    max_header_list_size: int
    keepalive: Keepalive
    unfinished_header_bytes: int  # kept by the connections (see http2_guard)
    pending_send: int  # answer bytes waiting for clients' windows, kept by the connections

    def accepting(self, connection: Http2Connection) -> bool:
        """Whether a new stream may open now (False: it is refused, and the client retries)."""

    def parse_head(self, headers: list[tuple[bytes, bytes]], stream_id: int) -> Any:
        """A request's decoded header list -> what :meth:`open_stream` gets (kept for blocks
        the client repeats, so it must not depend on anything but the headers, unless its
        ``cacheable`` attribute is false)."""

    def open_stream(self, connection: Http2Connection, stream: Stream, head: Any, end_stream: bool) -> StreamHandler | None:
        """A new request; ``None`` when it was answered at once (no handler needed)."""

    def connection_made(self, connection: Http2Connection) -> None:
        """``connection`` is made (after the TLS handshake, on a TLS port) and has sent its
        SETTINGS: it has no stream yet. A connection whose TLS handshake fails is never made,
        and never closed either (no :meth:`connection_closed`)."""

    def connection_idle(self, connection: Http2Connection) -> None:
        """``connection``'s last stream has ended (and no handler of a reset stream still works)."""

    def connection_busy(self, connection: Http2Connection) -> None:
        """``connection`` opens a stream after having none."""

    def connection_closed(self, connection: Http2Connection) -> None: ...


class Http2Connection(StreamWriter, ConnectionGuard, asyncio.Protocol):
    """One client connection (see the module's docstring)."""

    def __init__(self, owner: Http2Owner) -> None:
        self.owner = owner
        self.loop = asyncio.get_running_loop()
        self.transport: Any = None
        self.peer = ""
        self.streams: dict[int, Stream] = {}
        self.last_stream_id = 0  # the largest stream id the client opened
        self.closed = False
        self._buffer = b""  # what remains of the last read (an incomplete frame)
        self._preface = False
        self._settings_seen = False
        self._out: list[bytes] = []  # frames not yet written (see StreamWriter._write)
        self._receiving = False
        self._flush_soon = False
        self._max_block = max(2 * owner.max_header_list_size, 16 * 1024)
        self._decoder = hpack.Decoder(max_header_list_size=owner.max_header_list_size)
        self._heads: dict[bytes, Any] = {}
        self._table_changed = False
        self._block: list[bytes] = []  # a header block in CONTINUATION frames
        self._block_stream = 0
        self._block_flags = 0
        self._block_size = 0
        self._reset_ids: collections.deque[int] = collections.deque(maxlen=RESET_MEMORY)
        self._table_update = False  # the next header block sent starts with a table size update
        self._zombies = 0  # streams gone whose handlers still work
        self._opened = 0  # streams opened in this read
        self.buffered = 0  # request bytes this connection's calls hold (kept by the owner)
        self.pending_send = 0
        # the client's settings
        self._peer_window = h2.DEFAULT_WINDOW
        self._peer_max_frame = h2.DEFAULT_MAX_FRAME
        self._peer_table_size = 4096
        # windows
        self._send_window = h2.DEFAULT_WINDOW  # connection window for what this server sends
        self._recv_window = CONNECTION_WINDOW  # what the client may still send on the connection
        self._recv_unacked = 0
        self._blocked: dict[int, Stream] = {}  # streams with data waiting for window
        self._write_paused = False
        # keepalive, pings, limits, stop
        self._keepalive = owner.keepalive
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._guard_init()
        self._goaway_state = 0  # 1: first GOAWAY sent, 2: final GOAWAY sent
        self._goaway_last = h2.MAX_WINDOW
        self.remote_goaway = False
        self._refused = ""
        self.made_at = 0.0  # loop time of connection_made

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.made_at = self.loop.time()
        if self._refused:
            transport.write(h2.settings_frame({}) + h2.goaway(0, h2.ENHANCE_YOUR_CALM, self._refused.encode()))
            self._close_transport()
            return
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            host, port = peer[0], peer[1]
            self.peer = f"ipv6:[{host}]:{port}" if ":" in str(host) else f"ipv4:{host}:{port}"
        owner = self.owner
        settings = {
            h2.MAX_CONCURRENT_STREAMS: owner.max_concurrent_streams,
            h2.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            h2.MAX_HEADER_LIST_SIZE: owner.max_header_list_size,
        }
        transport.write(
            h2.settings_frame(settings) + h2.window_update(0, CONNECTION_WINDOW - h2.DEFAULT_WINDOW)
        )
        self._guard_start()
        owner.connection_made(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._block = []
        self._release_header_bytes()
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        streams, self.streams = list(self.streams.values()), {}
        self._blocked.clear()
        self.owner.pending_send -= self.pending_send
        self.pending_send = 0
        for stream in streams:
            stream.pending.clear()
            stream.pending_bytes = 0
            self._gone(stream, h2.CANCEL)
        self.owner.connection_closed(self)

    def pause_writing(self) -> None:
        self._write_paused = True
        self._pause_reading("write")  # a client that does not read is not answered into memory

    def resume_writing(self) -> None:
        self._write_paused = False
        self._resume_reading("write")
        for stream in list(self.streams.values()):
            if stream.pending_bytes <= WRITE_HIGH_WATER:
                self._wake(stream)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self._read_since_ping = True
        buffer = self._buffer + data if self._buffer else data
        self._receiving = True
        self._opened = 0
        try:
            at = self._frames(buffer)
        except H2ConnectionError as exc:
            self._fail(exc.code, exc.message)
            at = len(buffer)
        except Exception:
            logger.exception("gRPC connection from %s failed", self.peer)
            self._fail(h2.INTERNAL_ERROR, "internal error")
            at = len(buffer)
        finally:
            self._receiving = False
        self._buffer = bytes(buffer[at:]) if at < len(buffer) else b""
        self._flush_out()
        if self._opened >= NEW_STREAMS_PER_READ and self._buffer and not self.closed:
            # More streams wait in what was read: other connections and the calls just
            # opened get the event loop first.
            self._pause_reading("yield")
            self.loop.call_soon(self._read_on)

    def _read_on(self) -> None:
        self._resume_reading("yield")
        if not self.closed:
            self.data_received(b"")

    # -- reading frames ---------------------------------------------------------------------

    def _frames(self, buffer: bytes) -> int:
        """Process every whole frame of ``buffer``; returns how far it got."""
        at, end = 0, len(buffer)
        if not self._preface:
            if end < len(h2.PREFACE):
                if not h2.PREFACE.startswith(buffer[:end]):
                    raise H2ConnectionError(h2.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                return 0
            if buffer[: len(h2.PREFACE)] != h2.PREFACE:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            self._preface = True
            at = len(h2.PREFACE)
        view = memoryview(buffer)
        unpack = h2.FRAME_HEADER.unpack_from
        while end - at >= 9:
            high, low, kind, flags, stream_id = unpack(buffer, at)
            length = high << 8 | low
            if length > h2.DEFAULT_MAX_FRAME:
                raise H2ConnectionError(h2.FRAME_SIZE_ERROR, f"frame of {length} bytes is larger than SETTINGS_MAX_FRAME_SIZE")
            if end - at - 9 < length:
                break
            payload = view[at + 9 : at + 9 + length]
            at += 9 + length
            stream_id &= h2.MAX_WINDOW
            if not self._settings_seen:
                if kind != h2.SETTINGS or flags & h2.ACK:
                    raise H2ConnectionError(h2.PROTOCOL_ERROR, "the client's first frame must be SETTINGS")
                self._settings_seen = True
                self._cancel_timer("handshake")
            if self._block and kind != h2.CONTINUATION:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "a header block was interrupted")
            try:
                if kind == h2.DATA:
                    self._on_data(flags, stream_id, payload)
                elif kind == h2.HEADERS:
                    self._on_headers(flags, stream_id, payload)
                else:
                    self._on_control(kind, flags, stream_id, payload)
            except StreamError as exc:
                self._stream_error(exc)
            if self.closed:
                return end
            if self._opened >= NEW_STREAMS_PER_READ:
                break
        return at

    def _on_data(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id == 0:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "DATA on stream 0")
        length = len(payload)
        data = payload
        if flags & h2.PADDED:
            if length < 1 or payload[0] >= length:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "DATA padding longer than its frame")
            data = payload[1 : length - payload[0]]
        self._recv_window -= length
        if self._recv_window < 0:
            raise H2ConnectionError(h2.FLOW_CONTROL_ERROR, "the connection's flow-control window was exceeded")
        self.discard(length)  # streams' windows bound what the connection holds
        stream = self.streams.get(stream_id)
        if stream is None:
            self._closed_stream_frame(stream_id, "DATA")
            return
        if stream.remote_closed:
            raise StreamError(stream_id, h2.STREAM_CLOSED, "DATA after the end of the stream")
        stream.recv_window -= length
        if stream.recv_window < 0:
            raise StreamError(stream_id, h2.FLOW_CONTROL_ERROR, "the stream's flow-control window was exceeded")
        end_stream = bool(flags & h2.END_STREAM)
        if end_stream:
            stream.remote_closed = True
        handler = stream.handler
        if handler is not None:
            handler.data_received(data, end_stream)
        if end_stream and stream.local_closed:
            self._forget(stream)

    def _on_headers(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id == 0:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "HEADERS on stream 0")
        start, end = 0, len(payload)
        if flags & h2.PADDED:
            if end < 1 or payload[0] >= end:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "HEADERS padding longer than its frame")
            start, end = 1, end - payload[0]
        if flags & h2.PRIORITY_FLAG:
            if end - start < 5:
                raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            start += 5
        block = bytes(payload[start:end])
        if flags & h2.END_HEADERS:
            self._header_block(stream_id, flags, block)
        else:
            self._block, self._block_stream, self._block_flags = [block], stream_id, flags
            self._block_size = max(len(block), CONTINUATION_COST)
            self._hold_header_bytes(self._block_size)
            self._timer("header-block", HEADER_BLOCK_SECONDS, self._header_block_expired)

    def _on_continuation(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if not self._block or stream_id != self._block_stream:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "CONTINUATION without a header block in progress")
        if not payload and not flags & h2.END_HEADERS:
            raise H2ConnectionError(h2.ENHANCE_YOUR_CALM, "an empty CONTINUATION frame")
        cost = max(len(payload), CONTINUATION_COST)  # many small frames cost too
        self._block_size += cost
        if self._block_size > self._max_block:
            raise H2ConnectionError(h2.ENHANCE_YOUR_CALM, "header block too large")
        self._hold_header_bytes(cost)
        self._block.append(bytes(payload))
        if flags & h2.END_HEADERS:
            block, self._block = b"".join(self._block), []
            self._release_header_bytes()
            self._cancel_timer("header-block")
            self._header_block(stream_id, self._block_flags, block)

    def _header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        end_stream = bool(flags & h2.END_STREAM)
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers
            self._decode(block)
            if not end_stream:
                raise StreamError(stream_id, h2.PROTOCOL_ERROR, "trailers without END_STREAM")
            if stream.remote_closed:
                raise StreamError(stream_id, h2.STREAM_CLOSED, "HEADERS after the end of the stream")
            stream.remote_closed = True
            if stream.handler is not None:
                stream.handler.data_received(memoryview(b""), True)
            if stream.local_closed:
                self._forget(stream)
            return
        if stream_id % 2 == 0 or stream_id <= self.last_stream_id:
            self._decode(block)  # the table must follow the client's all the same
            if stream_id in self._reset_ids:
                return
            raise H2ConnectionError(h2.PROTOCOL_ERROR, f"HEADERS opening stream {stream_id}, not a new odd id")
        self.last_stream_id = stream_id
        head = self._head(block, stream_id)
        if stream_id > self._goaway_last:
            raise StreamError(stream_id, h2.REFUSED_STREAM, "the server is going away")
        if len(self.streams) + self._zombies >= self.owner.max_concurrent_streams:
            raise StreamError(stream_id, h2.REFUSED_STREAM, "too many concurrent streams")
        if not self.owner.accepting(self):
            raise StreamError(stream_id, h2.REFUSED_STREAM, "the server's buffers are full")
        self._opened += 1
        self._idle_since = None
        if not self.streams:
            self.owner.connection_busy(self)
        stream = Stream(stream_id, self._peer_window, STREAM_WINDOW)
        stream.remote_closed = end_stream
        self.streams[stream_id] = stream
        stream.handler = self.owner.open_stream(self, stream, head, end_stream)

    def _decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        """Decode a header block (every one: the HPACK table must follow the client's); a block
        that changes the table drops the kept readings (see the module's docstring)."""
        table = self._decoder.header_table
        entries = table.dynamic_entries
        first, count, size = entries[0] if entries else None, len(entries), table.maxsize
        try:
            headers: list[tuple[bytes, bytes]] = self._decoder.decode(block, raw=True)  # type: ignore[assignment]
        except _HPACK_ERRORS as exc:
            raise H2ConnectionError(h2.COMPRESSION_ERROR, f"header block does not decode: {exc}") from None
        finally:
            entries = table.dynamic_entries
            if (entries[0] if entries else None) is not first or len(entries) != count or table.maxsize != size:
                self._heads.clear()
                self._table_changed = True
        return headers

    def _head(self, block: bytes, stream_id: int) -> Any:
        """The owner's reading of a request's header block (see the module's docstring)."""
        head = self._heads.get(block)
        if head is not None:
            return head
        self._table_changed = False
        head = self.owner.parse_head(self._decode(block), stream_id)
        if not self._table_changed and len(block) <= HEAD_CACHE_BLOCK and getattr(head, "cacheable", True):
            if len(self._heads) >= HEAD_CACHE_SIZE:
                self._heads.clear()
            self._heads[block] = head
        return head

    def _on_control(self, kind: int, flags: int, stream_id: int, payload: memoryview) -> None:
        length = len(payload)
        if kind == h2.CONTINUATION:
            self._on_continuation(flags, stream_id, payload)
        elif kind == h2.SETTINGS:
            if stream_id:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "SETTINGS on a stream")
            if flags & h2.ACK:
                if length:
                    raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
                return
            if length % 6:
                raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "SETTINGS of a length not a multiple of 6")
            for key, value in h2.parse_settings(payload):
                self._setting(key, value)
            if self._induced_frame():
                self._write(h2.frame(h2.SETTINGS, h2.ACK, 0))
        elif kind == h2.WINDOW_UPDATE:
            if length != 4:
                raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "WINDOW_UPDATE of a length other than 4")
            self._window_update(stream_id, h2.u32(payload) & h2.MAX_WINDOW)
        elif kind == h2.PING:
            if length != 8:
                raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "PING of a length other than 8")
            if stream_id:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "PING on a stream")
            self._ping(flags, bytes(payload))
        elif kind == h2.RST_STREAM:
            if length != 4:
                raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "RST_STREAM of a length other than 4")
            if stream_id == 0 or stream_id > self.last_stream_id:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, f"RST_STREAM on idle stream {stream_id}")
            stream = self.streams.get(stream_id)
            if stream is not None:
                answered = stream.local_closed
                stream.reset = True
                self._forget(stream)
                self._gone(stream, h2.u32(payload))
                if not answered:
                    self._client_reset()
        elif kind == h2.GOAWAY:
            if stream_id:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "GOAWAY on a stream")
            if length < 8:
                raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "GOAWAY shorter than 8 bytes")
            _, code = h2.goaway_fields(payload)
            if code != h2.NO_ERROR:
                logger.debug("gRPC client %s went away with error %d: %r", self.peer, code, bytes(payload[8:]))
            self.remote_goaway = True
            self._maybe_close()
        elif kind == h2.PRIORITY:
            if stream_id == 0:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "PRIORITY on stream 0")
            if stream_id > self.last_stream_id and length == 5 and h2.u32(payload) & h2.MAX_WINDOW != stream_id:
                return  # a priority for a stream not yet open: allowed, and ignored
            if length != 5:
                raise StreamError(stream_id, h2.FRAME_SIZE_ERROR, "PRIORITY of a length other than 5")
            if h2.u32(payload) & h2.MAX_WINDOW == stream_id:
                raise StreamError(stream_id, h2.PROTOCOL_ERROR, "a stream cannot depend on itself")
        elif kind == h2.PUSH_PROMISE:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # other frame types are extensions this server does not know: ignored (RFC 9113 5.5)

    def _setting(self, key: int, value: int) -> None:
        if key == h2.INITIAL_WINDOW_SIZE:
            if value > h2.MAX_WINDOW:
                raise H2ConnectionError(h2.FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE above 2^31-1")
            delta, self._peer_window = value - self._peer_window, value
            for stream in self.streams.values():
                stream.send_window += delta
                if stream.send_window > h2.MAX_WINDOW:
                    raise H2ConnectionError(h2.FLOW_CONTROL_ERROR, "a stream's window went past 2^31-1")
            if delta > 0:
                self._flush_blocked()
        elif key == h2.MAX_FRAME_SIZE:
            if not h2.DEFAULT_MAX_FRAME <= value <= h2.LARGEST_FRAME:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE {value} out of range")
            self._peer_max_frame = value
        elif key == h2.ENABLE_PUSH:
            if value > 1:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH other than 0 or 1")
        elif key == h2.HEADER_TABLE_SIZE and value != self._peer_table_size:
            self._peer_table_size = value
            self._table_update = True  # this server's table stays empty: it says so, size 0

    def _window_update(self, stream_id: int, increment: int) -> None:
        if stream_id == 0:
            if increment == 0:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "WINDOW_UPDATE of 0 on the connection")
            self._send_window += increment
            if self._send_window > h2.MAX_WINDOW:
                raise H2ConnectionError(h2.FLOW_CONTROL_ERROR, "the connection's window went past 2^31-1")
            self._flush_blocked()
            return
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id > self.last_stream_id:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {stream_id}")
            return  # a stream that has ended
        if increment == 0:
            raise StreamError(stream_id, h2.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
        stream.send_window += increment
        if stream.send_window > h2.MAX_WINDOW:
            raise StreamError(stream_id, h2.FLOW_CONTROL_ERROR, "the stream's window went past 2^31-1")
        if stream.pending or stream.trailers is not None:
            self._flush_stream(stream)

    def _closed_stream_frame(self, stream_id: int, kind: str) -> None:
        if stream_id > self.last_stream_id:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, f"{kind} on idle stream {stream_id}")
        if stream_id not in self._reset_ids:
            raise StreamError(stream_id, h2.STREAM_CLOSED, f"{kind} on closed stream {stream_id}")

    # -- the connection's end -----------------------------------------------------------------

    def shutdown(self) -> None:
        """Graceful stop: no new streams once the client has seen it; the streams in progress
        finish, then the connection closes."""
        if self._goaway_state or self.closed or self.transport is None:
            return  # (not yet made: the owner stops it when it is, see Http2Owner.connection_made)
        self._goaway_state = 1
        self._write(h2.goaway(h2.MAX_WINDOW, h2.NO_ERROR) + h2.frame(h2.PING, 0, 0, _GOAWAY_PING))
        self._timer("goaway", GOAWAY_PING_SECONDS, self._final_goaway)

    def silent_for(self, now: float) -> float:
        """How long since it was made the client has sent not one byte (0 once it has)."""
        if self._preface or self._buffer or self.transport is None:
            return 0.0
        return now - self.made_at

    @property
    def working(self) -> bool:
        """Whether handlers of streams already gone still work (calls in progress, see _gone)."""
        return self._zombies > 0

    def refuse(self, message: str) -> None:
        """A connection the server will not serve: GOAWAY (ENHANCE_YOUR_CALM) once it is made."""
        self._refused = message

    def cancel_idle_streams(self) -> None:
        """Reset the streams with nothing on their way to the client (open streams and health
        watches that wait for more): a stop must not wait for them."""
        for stream in list(self.streams.values()):
            if not stream.local_closed and not stream.pending and stream.trailers is None:
                self.reset_stream(stream, h2.CANCEL)
                self._gone(stream, h2.CANCEL)

    def _final_goaway(self) -> None:
        if self._goaway_state != 1 or self.closed:
            return
        self._goaway_state = 2
        self._cancel_timer("goaway")
        self._goaway_last = self.last_stream_id
        self._write(h2.goaway(self.last_stream_id, h2.NO_ERROR))
        self._maybe_close()

    def _maybe_close(self) -> None:
        if not self.streams and (self._goaway_state == 2 or self.remote_goaway) and not self.closed:
            self._flush_out()
            self._close_transport()

    def _fail(self, code: int, message: str) -> None:
        """A connection error: GOAWAY with ``code`` and ``message``, then close."""
        if self.closed or self.transport is None:
            return
        logger.debug("gRPC client %s: connection error %d: %s", self.peer, code, message)
        self._write(h2.goaway(self.last_stream_id, code, message.encode("utf-8", "replace")[:256]))
        self._flush_out()
        self._close_transport()

    def abort(self) -> None:
        """Close now: every stream's handler is told the connection went away."""
        if not self.closed and self.transport is not None:
            self._flush_out()
            self._close_transport()

    def _close_transport(self) -> None:
        """Close the transport once what it holds is written; a client that takes none of it
        for :data:`CLOSE_STALL_SECONDS`, or has not taken all of it
        :data:`CLOSE_DEADLINE_SECONDS` after, is cut off (``abort``): ``close`` alone would wait
        for it (and the owner hold the connection) for good. Over TLS the transport's buffer
        is the TLS layer's alone (what it passed on to the socket is not in it), so only the
        TLS transport's own shutdown timeout (the listener's, the same deadline) bounds it."""
        if self.transport.get_extra_info("sslcontext") is None:
            self._close_watch(-1, self.loop.time() + CLOSE_DEADLINE_SECONDS)
        self.transport.close()
        self.closed = True

    def _close_watch(self, left: int, deadline: float) -> None:
        size = self.transport.get_write_buffer_size()
        if (left < 0 or size < left) and self.loop.time() < deadline:
            wait = min(CLOSE_STALL_SECONDS, max(0.0, deadline - self.loop.time()))
            self._timers["close"] = self.loop.call_later(wait, self._close_watch, size, deadline)
        else:
            logger.debug("gRPC client %s has not taken the last %d bytes: connection cut", self.peer, size)
            self.transport.abort()

    def _flush_out(self) -> None:
        self._flush_soon = False
        out = self._out
        if out and not self.closed:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))
        out.clear()


__all__ = [
    "CONNECTION_WINDOW", "STREAM_WINDOW", "WRITE_HIGH_WATER", "Http2Connection", "Http2Owner", "Keepalive", "Stream",
    "StreamHandler",
]
