"""Quiver's own gRPC server: HTTP/2 on the asyncio event loop (:mod:`quiver.frontends.http2`),
gRPC's semantics per call (:mod:`quiver.frontends.grpc_call`), methods dispatched by ``:path``.

It replaces ``grpc.aio.server`` (``--grpc-server quiver``, the default; ``grpcio`` keeps the
old one): a ``grpc.aio`` server spends about 100-140 us of event-loop time per call in its
own machinery before any of Quiver's code runs, plus gRPC core's threads and a poller that
wakes the loop per completion; this server reads and writes the socket on the loop itself.

What a request's header block says is read once per distinct block (:meth:`GrpcServer.parse_head`,
kept by the connection for blocks a client repeats): the method, the call metadata (``-bin``
values base64-decoded, as grpcio gives them), ``grpc-timeout``, ``grpc-encoding`` and whether the
client accepts gzip, and what refuses the call before it starts: a request that is not a gRPC
POST, an unknown method (UNIMPLEMENTED, ``Method not found!`` as grpcio says), an encoding
this server does not speak, metadata past the header list size, and the restricted protocols
(``--grpc-restricted-protocol``, by the method's API group).

At most ``max_connections`` connections are served at once (:func:`connection_cap`: 10,000, or
half the file descriptors the process may open when that is fewer). A connection that comes
when they are all taken makes room if it can: the connection idle the longest (no stream open,
no call working) is asked to go as a stop asks (GOAWAY NO_ERROR with the largest stream id and
a PING, then GOAWAY with the last stream it opened; a stream it opens before it has seen the
first is served; so too for one that has not yet sent its preface and SETTINGS, as the server's
SETTINGS are out: its client may have sent a call already, which closing at once would fail
UNAVAILABLE, and grpc-go likewise drains a connection that comes after its graceful stop began),
and the newcomer is served; gRPC clients reconnect when they next call. Connections
asked to go no longer count against the cap, but at most ``max(16, max_connections // 16)`` of
them may still be open at once (a client that keeps one busy in its last moments cannot make
the server hold more); when every connection is busy, the newcomer is refused (GOAWAY
ENHANCE_YOUR_CALM) as before. A connection counts from its accept; on a TLS port it joins
:attr:`GrpcServer.connections` only once its TLS handshake is done (``connection_made``, within
:data:`TLS_HANDSHAKE_SECONDS`), and one whose handshake fails is never made nor closed: until
then it is held weakly, so it stops counting when the TLS layer drops it (at once with uvloop;
with asyncio's own loop when the garbage collector frees its reference cycle), or after
:data:`UNMADE_SECONDS` at most.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import os
import re
import resource
import socket
import ssl
import tempfile
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from quiver.frontends import http2_frames as h2
from quiver.frontends.grpc_call import GrpcCall, metadata_fields, percent_encoded
from quiver.frontends.grpc_receive import ReceiveBudget
from quiver.frontends.http2 import CLOSE_DEADLINE_SECONDS, Http2Connection, Keepalive, Stream
from quiver.frontends.http2_guard import HANDSHAKE_SECONDS
from quiver.frontends.restrictions import Restrictions
from quiver.triton_flags import GrpcTls

logger = logging.getLogger(__name__)

#: A connection whose client has sent nothing this long after it connected is closed at once
#: to make room, not asked to go (see GrpcServer._make_room).
SILENT_SECONDS = 1.0
#: Streams one connection may have open at once (SETTINGS_MAX_CONCURRENT_STREAMS).
MAX_CONCURRENT_STREAMS = 1024
#: The largest request header list (names, values and 32 bytes per field, as HTTP/2 counts);
#: announced, and a larger one ends the connection (HPACK must stay in step).
MAX_HEADER_LIST_SIZE = 64 * 1024
#: Connections served at once; past it the one idle the longest is asked to go, or, when all
#: are busy, the newcomer is answered GOAWAY and closed (see the module's docstring).
MAX_CONNECTIONS = 10_000
#: At least this many connections, however few file descriptors the process may open.
MIN_CONNECTIONS = 64
#: Answer bytes one connection may have waiting for its client's windows before its new
#: streams are refused (their answers could not go out either); on all connections, four of
#: the largest answers (at least 256 MiB) before every connection's are.
MAX_PENDING_SEND = 64 << 20
#: Calls in progress at once on all connections (each holds its state and a task, 1-10 KB before
#: any request byte); past it new streams are refused (REFUSED_STREAM, which clients retry).
MAX_CALLS = 20_000
#: The TLS handshake's time limit (the connection's preface must come as soon, see
#: http2_guard), and how long a connection accepted may take to be made (TLS handshake done)
#: before it no longer counts against the cap.
TLS_HANDSHAKE_SECONDS = HANDSHAKE_SECONDS
UNMADE_SECONDS = TLS_HANDSHAKE_SECONDS + 5.0
#: Request fields that are the transport's, not the call's metadata.
_TRANSPORT_FIELDS = frozenset((b"content-type", b"te", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding"))
_TIMEOUT = re.compile(rb"(\d{1,8})([HMSmun])")
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_ENCODINGS = ("identity", "gzip", "deflate")


@dataclass(frozen=True, slots=True)
class RpcMethod:
    """A method the server dispatches to: ``handler(request, context)``, a coroutine function
    (or, for a streaming response, an async generator function or one that writes with
    ``context.write``). ``parse`` and ``serialize`` turn message bytes into objects and back
    (``None``: the handler takes and returns bytes)."""

    name: str  # the :path, "/package.Service/Method"
    handler: Callable[..., Any]
    request_streaming: bool = False
    response_streaming: bool = False
    parse: Callable[[bytes], Any] | None = None
    serialize: Callable[[Any], bytes] | None = None
    compressed: bool = False  # answered gzip'd at --grpc-infer-response-compression-level
    group: str | None = None  # the API group --grpc-restricted-protocol names

    @property
    def unary(self) -> bool:
        return not (self.request_streaming or self.response_streaming)


@dataclass(frozen=True, slots=True)
class RequestHead:
    """What a request's header block says (see the module's docstring)."""

    method: RpcMethod | None
    metadata: tuple[tuple[str, Any], ...]
    timeout: float | None
    encoding: str
    accepts_gzip: bool
    refusal: tuple[int, grpc.StatusCode, str] | None  # HTTP status, gRPC status and message

    @property
    def cacheable(self) -> bool:
        """Refusals are read again each time (they are rare, and may be large)."""
        return self.refusal is None


def keepalive_from(options: Sequence[tuple[str, int]]) -> Keepalive:
    """The keepalive and ping channel arguments (``--grpc-keepalive-*`` ...) as :class:`Keepalive`."""
    given = dict(options)
    default = Keepalive()

    def seconds(name: str, fallback: float | None) -> float | None:
        value = given.get(name)
        if value is None:
            return fallback
        return None if value >= 2**31 - 1 else value / 1000.0

    time = seconds("grpc.keepalive_time_ms", default.time)
    timeout = seconds("grpc.keepalive_timeout_ms", default.timeout)
    interval = seconds("grpc.http2.min_ping_interval_without_data_ms", default.min_recv_ping_interval)
    return Keepalive(
        time=time,
        timeout=timeout if timeout is not None else default.timeout,
        permit_without_calls=bool(given.get("grpc.keepalive_permit_without_calls", 0)),
        max_pings_without_data=int(given.get("grpc.http2.max_pings_without_data", default.max_pings_without_data)),
        min_recv_ping_interval=interval if interval is not None else default.min_recv_ping_interval,
        max_ping_strikes=int(given.get("grpc.http2.max_ping_strikes", default.max_ping_strikes)),
        max_connection_age=seconds("grpc.max_connection_age_ms", None),
        max_connection_age_grace=seconds("grpc.max_connection_age_grace_ms", None),
    )


def connection_cap(descriptors: int | None = None) -> int:
    """Connections served at once: :data:`MAX_CONNECTIONS`, or half of ``descriptors`` (the
    process's soft ``RLIMIT_NOFILE`` when not given) when that is fewer, but at least
    :data:`MIN_CONNECTIONS`. With the common soft limit of 1,024, accepting would otherwise fail
    for want of a descriptor (and asyncio stop the listener for a second at a time) long before
    the cap, where no idle connection is asked to make room; the other half is left for HTTP
    connections, model files and worker processes' pipes."""
    if descriptors is None:
        descriptors = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if descriptors == resource.RLIM_INFINITY or descriptors < 0:
        return MAX_CONNECTIONS
    return min(MAX_CONNECTIONS, max(MIN_CONNECTIONS, descriptors // 2))


def tls_context(tls: GrpcTls) -> ssl.SSLContext:
    """A server TLS context for ``tls`` (ALPN ``h2``; client certificates signed by the root
    certificate required when mutual)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    with tempfile.TemporaryDirectory(prefix="quiver-tls-") as folder:  # load_cert_chain reads files
        cert, key = Path(folder) / "cert.pem", Path(folder) / "key.pem"
        for path, data in ((cert, tls.server_cert), (key, tls.server_key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
        context.load_cert_chain(cert, key)
    if tls.root_cert is not None:
        context.load_verify_locations(cadata=tls.root_cert.decode("ascii", "replace"))
    context.verify_mode = ssl.CERT_REQUIRED if tls.mutual else ssl.CERT_NONE
    return context


def _timeout(value: bytes) -> float | None:
    match = _TIMEOUT.fullmatch(value)
    if match is None:
        return None
    return int(match.group(1)) * _TIMEOUT_UNITS[match.group(2)]


def _binary(value: bytes) -> bytes:
    value = value.strip()
    return base64.b64decode(value + b"=" * (-len(value) % 4), validate=True)


class GrpcServer:
    """The listener(s) and the connections of one gRPC server (an :class:`http2.Http2Owner`)."""

    def __init__(
        self,
        methods: dict[str, RpcMethod],
        *,
        max_receive_message_size: int,
        max_send_message_size: int,
        restrictions: Restrictions | None = None,
        compression_level: int = 0,
        keepalive: Keepalive | None = None,
        max_concurrent_streams: int = MAX_CONCURRENT_STREAMS,
        max_header_list_size: int = MAX_HEADER_LIST_SIZE,
        max_calls: int = MAX_CALLS,
        max_connections: int | None = None,
        on_request: Callable[[], None] | None = None,
    ) -> None:
        self.methods = methods
        #: Called as each call's stream opens (the model side's idle detector:
        #: ``InferenceService.request_came``).
        self.on_request = on_request
        self.max_receive_message_size = max_receive_message_size
        self.max_send_message_size = max_send_message_size
        self.restrictions = restrictions or Restrictions()
        self.compression_level = compression_level
        self.keepalive = keepalive or Keepalive()
        self.max_concurrent_streams = max_concurrent_streams
        self.max_header_list_size = max_header_list_size
        self.max_calls = max_calls
        self.calls = 0  # calls in progress (GrpcCall counts itself in and out)
        self.unfinished_header_bytes = 0  # kept by the connections
        self.pending_send = 0  # answer bytes waiting for clients' windows, kept by the connections
        self.max_pending_send = max(4 * max_send_message_size, 256 << 20)
        #: Request bytes received and not yet taken by handlers, at most: twice the largest
        #: message (at least 256 MiB) in all, and a message and a window per connection.
        self.budget = ReceiveBudget(
            max(2 * max_receive_message_size, 256 << 20), max_receive_message_size + (2 << 20)
        )
        self.connections: set[Http2Connection] = set()
        self.max_connections = connection_cap() if max_connections is None else max_connections
        #: Connections with no stream open, the one idle the longest first (kept by the
        #: connections through connection_idle and connection_busy; checked when one is taken).
        self._idle: dict[Http2Connection, None] = {}
        #: Connections asked to go to make room, until they close.
        self._leaving: set[Http2Connection] = set()
        #: Connections accepted and not yet made (their TLS handshake under way), each until
        #: when it may be: they count against the cap, but are not in :attr:`connections` (one
        #: whose handshake fails is never made nor closed: it is gone from here when the TLS
        #: layer drops it, or once its time is up).
        self._unmade: weakref.WeakKeyDictionary[Http2Connection, float] = weakref.WeakKeyDictionary()
        self._stopping = False
        self._listeners: list[asyncio.AbstractServer] = []
        self._unary_calls = 0
        self._no_unary_calls = asyncio.Event()
        self._no_unary_calls.set()
        self._no_connections = asyncio.Event()
        self._no_connections.set()

    # -- http2.Http2Owner ---------------------------------------------------------------------

    def parse_head(self, headers: list[tuple[bytes, bytes]], stream_id: int) -> RequestHead:
        pseudo, fields = h2.request_head(stream_id, headers)
        metadata: list[tuple[str, Any]] = []
        timeout: float | None = None
        encoding = "identity"
        accepts_gzip = False
        content_type = b""
        refusal: tuple[int, grpc.StatusCode, str] | None = None
        for name, value in fields:
            if name in _TRANSPORT_FIELDS:
                if name == b"content-type":
                    content_type = value
                elif name == b"grpc-timeout":
                    timeout = _timeout(value)
                    if timeout is None:
                        refusal = (200, grpc.StatusCode.INTERNAL, f"invalid grpc-timeout {value.decode('latin-1')!r}")
                elif name == b"grpc-encoding":
                    encoding = value.decode("latin-1").strip().lower()
                elif name == b"grpc-accept-encoding":
                    accepts_gzip = b"gzip" in (part.strip().lower() for part in value.split(b","))
                continue
            key = name.decode("latin-1")
            if key.endswith("-bin"):
                try:
                    metadata.append((key, _binary(value)))
                except (binascii.Error, ValueError):
                    refusal = refusal or (200, grpc.StatusCode.INTERNAL, f"metadata '{key}' is not base64")
            else:
                metadata.append((key, value.decode("latin-1")))
        method = self.methods.get(pseudo[b":path"].decode("latin-1"))
        if pseudo[b":method"] != b"POST":
            refusal = (405, grpc.StatusCode.UNIMPLEMENTED, "a gRPC request must be a POST")
        elif not (content_type == b"application/grpc" or content_type.startswith((b"application/grpc+", b"application/grpc;"))):
            refusal = (415, grpc.StatusCode.INTERNAL, f"content-type '{content_type.decode('latin-1')}' is not gRPC's")
        elif method is None:
            refusal = (200, grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        elif encoding not in _ENCODINGS:
            refusal = (200, grpc.StatusCode.UNIMPLEMENTED, f"Compression algorithm '{encoding}' is not supported")
        elif refusal is None and method.group is not None and self.restrictions:
            denied = self.restrictions.denied(
                method.group, {key: value for key, value in metadata if isinstance(value, str)}, grpc=True
            )
            if denied is not None:
                refusal = (200, grpc.StatusCode.PERMISSION_DENIED, denied)
        return RequestHead(method, tuple(metadata), timeout, encoding, accepts_gzip, refusal)

    def accepting(self, connection: Http2Connection) -> bool:
        return (
            self.calls < self.max_calls and self.budget.room(connection)
            and connection.pending_send < MAX_PENDING_SEND and self.pending_send < self.max_pending_send
        )

    def open_stream(self, connection: Http2Connection, stream: Stream, head: RequestHead, end_stream: bool) -> GrpcCall | None:
        if self.on_request is not None:
            self.on_request()
        if head.refusal is not None:
            status, code, details = head.refusal
            block = h2.header_block([
                (b":status", str(status).encode()), (b"content-type", b"application/grpc"),
                (b"grpc-status", str(code.value[0]).encode()), (b"grpc-message", percent_encoded(details)),
            ])
            connection.send_headers(stream, block, end_stream=True)
            return None
        call = GrpcCall(self, connection, stream, head)
        if end_stream:
            call.data_received(memoryview(b""), True)
        return call

    def connection_made(self, connection: Http2Connection) -> None:
        self._unmade.pop(connection, None)
        self.connections.add(connection)
        self._no_connections.clear()
        if self._stopping:
            connection.shutdown()  # made after the stop began (its TLS handshake was under way)
        else:
            self.connection_idle(connection)

    def connection_idle(self, connection: Http2Connection) -> None:
        self._idle.pop(connection, None)
        self._idle[connection] = None  # the most recently active last

    def connection_busy(self, connection: Http2Connection) -> None:
        self._idle.pop(connection, None)

    def connection_closed(self, connection: Http2Connection) -> None:
        self.connections.discard(connection)
        self._idle.pop(connection, None)
        self._leaving.discard(connection)
        if not self.connections:
            self._no_connections.set()

    def _connection(self) -> Http2Connection:
        connection = Http2Connection(self)
        taken = len(self.connections) - len(self._leaving) + self._unmade_count()
        if taken >= self.max_connections and not self._make_room():
            connection.refuse("too many connections")
            return connection
        self._unmade[connection] = connection.loop.time() + UNMADE_SECONDS  # until connection_made
        return connection

    def _unmade_count(self) -> int:
        """Connections accepted and not yet made, those past their time dropped first."""
        unmade = self._unmade
        if unmade:
            now = asyncio.get_running_loop().time()
            expired = []
            for connection, until in unmade.items():  # oldest first
                if until > now:
                    break
                expired.append(connection)
            for connection in expired:
                del unmade[connection]
        return len(unmade)

    def _make_room(self) -> bool:
        """Ask the connection idle the longest to go (see the module's docstring); False when
        none can. One whose client has sent not a byte for :data:`SILENT_SECONDS` (a gRPC
        client sends its preface as it connects: no call can be on its way) is closed at once,
        whatever the number on their way out: connections that never speak cannot hold
        newcomers off for the final GOAWAY's wait."""
        full = len(self._leaving) >= max(16, self.max_connections // 16)
        idle = self._idle
        now = asyncio.get_running_loop().time()
        while idle:
            connection = next(iter(idle))
            if connection.closed or connection.streams or connection.working or connection in self._leaving:
                del idle[connection]  # a busy one comes back once idle (connection_idle)
                continue
            silent = connection.silent_for(now) >= SILENT_SECONDS
            if full and not silent:
                return False
            del idle[connection]
            self._leaving.add(connection)  # until connection_closed
            if silent:
                logger.debug("gRPC: %d connections: %s, silent since it connected, is closed", len(self.connections), connection.peer)
                connection.abort()
            else:
                logger.debug("gRPC: %d connections: the one idle the longest (%s) is asked to go", len(self.connections), connection.peer)
                connection.shutdown()  # its preface not yet come, too: a call on its way is served
            return True
        return False

    # -- calls in progress ------------------------------------------------------------------

    def calls_started(self) -> None:
        self._unary_calls += 1
        self._no_unary_calls.clear()

    def calls_ended(self) -> None:
        self._unary_calls -= 1
        if not self._unary_calls:
            self._no_unary_calls.set()

    async def wait_unary_calls(self) -> None:
        """Until no unary call is in progress."""
        await self._no_unary_calls.wait()

    # -- listening and stopping ----------------------------------------------------------------

    async def start(self, address: str, port: int, *, ssl_context: ssl.SSLContext | None = None, reuse_port: bool = False) -> int:
        """Listen on ``address:port`` (every address it resolves to; port 0: a free one, the
        same for all); returns the port."""
        target = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        loop = asyncio.get_running_loop()
        sockets: list[socket.socket] = []
        try:
            infos = await loop.getaddrinfo(address or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            addresses = list(dict.fromkeys((family, sockaddr[0]) for family, _, _, _, sockaddr in infos))
            both = len({family for family, _ in addresses}) > 1
            for family, host in addresses:
                sock = socket.socket(family, socket.SOCK_STREAM)
                sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if reuse_port:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6 and both:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind((host, port))
                port = port or sock.getsockname()[1]
            for sock in sockets:
                self._listeners.append(
                    await loop.create_server(
                        self._connection, sock=sock, ssl=ssl_context, backlog=1024,
                        ssl_handshake_timeout=TLS_HANDSHAKE_SECONDS if ssl_context is not None else None,
                        ssl_shutdown_timeout=CLOSE_DEADLINE_SECONDS if ssl_context is not None else None,
                    )
                )
        except OSError as exc:
            for listener in self._listeners:
                listener.close()
            for sock in sockets:
                sock.close()
            raise OSError(f"cannot listen on {target} (gRPC): {exc.strerror or exc}") from None
        return port

    def begin_stop(self) -> None:
        """Accept no more connections; each connection refuses new calls (GOAWAY) and closes
        once its calls have ended (one made later, its TLS handshake under way now, as soon as
        it is made)."""
        self._stopping = True
        for listener in self._listeners:
            listener.close()
        for connection in list(self.connections):
            connection.shutdown()

    async def drain(self, timeout: float) -> None:
        """After :meth:`begin_stop` and the calls: streams with nothing on their way to the
        client (open streams, health watches) are reset, answers still being sent finish
        within ``timeout`` (each connection closes once its streams are done)."""
        for connection in list(self.connections):
            connection.cancel_idle_streams()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._no_connections.wait(), max(timeout, 0.0))

    async def close(self, timeout: float = 5.0) -> None:
        """Close every connection now (the calls still in progress are cancelled)."""
        self.begin_stop()
        for connection in list(self.connections):
            connection.abort()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._no_connections.wait(), timeout)
        self._listeners.clear()


__all__ = [
    "MAX_CALLS", "MAX_CONCURRENT_STREAMS", "MAX_CONNECTIONS", "MIN_CONNECTIONS", "GrpcServer", "RequestHead", "RpcMethod",
    "connection_cap", "keepalive_from", "metadata_fields", "tls_context",
]
