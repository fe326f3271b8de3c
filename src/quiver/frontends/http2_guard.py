"""What keeps one HTTP/2 connection of Quiver's gRPC server (:mod:`quiver.frontends.http2`)
alive, and what keeps a client from making it cost more than it should.

- gRPC's keepalive and ping channel arguments (:class:`Keepalive`): server pings, the client
  ping policy (strikes, then GOAWAY ``too_many_pings``), a maximum connection age.
- Time limits: the preface and SETTINGS, a header block still in CONTINUATION frames (and the
  bytes of such blocks on all connections, :data:`MAX_UNFINISHED_HEADER_BYTES`), a
  connection with no stream for :data:`IDLE_SECONDS` (GOAWAY, as gRPC's max connection idle),
  and an answer that waits for window: a stream whose data has waited for the client's window
  for :data:`STALL_SECONDS` is reset, which frees what it holds.
- Floods: frames the server must answer (SETTINGS and PING acknowledgements, resets of streams
  the client got wrong) counted since the server last sent a stream anything, past
  :data:`MAX_INDUCED_FRAMES` GOAWAY ENHANCE_YOUR_CALM (gRPC core's ``max_pending_induced_frames``);
  streams the client resets before their answer, a budget of :data:`RESET_BURST` refilled at
  :data:`RESETS_PER_SECOND` (the "rapid reset" attack), past it GOAWAY ENHANCE_YOUR_CALM; and
  reading stops while the transport cannot write (a client that sends and never reads is not
  answered into memory).
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from quiver.frontends import http2_frames as h2

logger = logging.getLogger(__name__)

#: A connection that has not sent its preface and SETTINGS within this many seconds is closed.
HANDSHAKE_SECONDS = 20.0
#: A header block (HEADERS, then CONTINUATION) not finished within this many seconds ends the connection.
HEADER_BLOCK_SECONDS = 5.0
#: A connection with no stream for this long is asked to go (GOAWAY; clients reconnect).
IDLE_SECONDS = 600.0
#: A stream whose answer has waited this long for the client's window is reset.
STALL_SECONDS = 60.0
#: How often idle connections and stalled streams are looked for.
HOUSEKEEPING_SECONDS = 10.0
#: Bytes of header blocks not yet finished (HEADERS, then CONTINUATION) on all connections at
#: once; the connection that would take them past it ends (ENHANCE_YOUR_CALM).
MAX_UNFINISHED_HEADER_BYTES = 32 << 20
#: Frames the server must answer, since it last sent a stream anything, before GOAWAY.
MAX_INDUCED_FRAMES = 10_000
#: Streams a client may reset before their answer at once, and per second after that.
RESET_BURST = 200.0
RESETS_PER_SECOND = 100.0

GOAWAY_PING = b"qgoaway\x00"
KEEPALIVE_PING = b"qkeepal\x00"


@dataclass(frozen=True)
class Keepalive:
    """gRPC's keepalive and ping channel arguments, in seconds (``None``: never)."""

    time: float | None = 7200.0  # grpc.keepalive_time_ms (2 hours for a server)
    timeout: float = 20.0  # grpc.keepalive_timeout_ms
    permit_without_calls: bool = False  # grpc.keepalive_permit_without_calls
    max_pings_without_data: int = 2  # grpc.http2.max_pings_without_data (0: unlimited)
    min_recv_ping_interval: float = 300.0  # grpc.http2.min_ping_interval_without_data_ms
    max_ping_strikes: int = 2  # grpc.http2.max_ping_strikes (0: unlimited)
    max_connection_age: float | None = None  # grpc.max_connection_age_ms
    max_connection_age_grace: float | None = None  # grpc.max_connection_age_grace_ms


class ConnectionGuard:
    """The timers and limits of :class:`~quiver.frontends.http2.Http2Connection`."""

    loop: asyncio.AbstractEventLoop
    owner: Any
    transport: Any
    peer: str
    closed: bool
    streams: dict[int, Any]
    _keepalive: Keepalive
    _timers: dict[str, asyncio.TimerHandle]
    _preface: bool
    _goaway_state: int
    _blocked: dict[int, Any]

    def _guard_init(self) -> None:
        self._read_since_ping = False
        self._pings_without_data = 0
        self._ping_strikes = 0
        self._last_ping_received: float | None = None
        self._induced = 0
        self._reset_tokens = RESET_BURST
        self._reset_at = self.loop.time()
        self._read_pauses: set[str] = set()
        self._idle_since: float | None = self.loop.time()
        self._header_bytes = 0  # of the header block in progress, counted on the owner

    def _guard_start(self) -> None:
        self._timer("handshake", HANDSHAKE_SECONDS, self._handshake_expired)
        self._timer("housekeeping", HOUSEKEEPING_SECONDS, self._housekeeping)
        keepalive = self._keepalive
        if keepalive.time is not None:
            self._timer("keepalive", keepalive.time, self._keepalive_tick)
        if keepalive.max_connection_age is not None:
            age = keepalive.max_connection_age * random.uniform(0.9, 1.1)  # jitter, as gRPC
            self._timer("age", age, self._age_reached)

    if TYPE_CHECKING:  # the connection's and its writer's (quiver.frontends.http2, http2_stream)

        def _write(self, data: bytes) -> None: ...

        def _fail(self, code: int, message: str) -> None: ...

        def abort(self) -> None: ...

        def shutdown(self) -> None: ...

        def _final_goaway(self) -> None: ...

        def _stall_reset(self, stream: Any) -> None: ...

    # -- floods ---------------------------------------------------------------------------

    def _hold_header_bytes(self, cost: int) -> None:
        """A header block in progress grew by ``cost``: counted on the owner, for all connections."""
        self._header_bytes += cost
        self.owner.unfinished_header_bytes += cost
        if self.owner.unfinished_header_bytes > MAX_UNFINISHED_HEADER_BYTES:
            raise h2.ConnectionError(h2.ENHANCE_YOUR_CALM, "too many unfinished header blocks on the server")

    def _release_header_bytes(self) -> None:
        self.owner.unfinished_header_bytes -= self._header_bytes
        self._header_bytes = 0

    def _induced_frame(self) -> bool:
        """One more frame the client made the server send; False (and GOAWAY) past the limit."""
        self._induced += 1
        if self._induced > MAX_INDUCED_FRAMES:
            self._fail(h2.ENHANCE_YOUR_CALM, "too many frames to answer")
            return False
        return True

    def _sent_stream_data(self) -> None:
        """The server sent a stream headers or data: the client's pings and control frames
        are answered afresh."""
        self._induced = 0
        self._pings_without_data = 0
        self._ping_strikes, self._last_ping_received = 0, None

    def _client_reset(self) -> bool:
        """A stream the client reset before its answer; False (and GOAWAY) past the budget."""
        now = self.loop.time()
        self._reset_tokens = min(RESET_BURST, self._reset_tokens + (now - self._reset_at) * RESETS_PER_SECOND)
        self._reset_at = now
        self._reset_tokens -= 1.0
        if self._reset_tokens < 0:
            self._fail(h2.ENHANCE_YOUR_CALM, "too many streams reset")
            return False
        return True

    def _pause_reading(self, reason: str) -> None:
        if not self._read_pauses and not self.closed:
            self.transport.pause_reading()
        self._read_pauses.add(reason)

    def _resume_reading(self, reason: str) -> None:
        if reason in self._read_pauses:
            self._read_pauses.discard(reason)
            if not self._read_pauses and not self.closed:
                self.transport.resume_reading()

    # -- pings and keepalive --------------------------------------------------------------------

    def _ping(self, flags: int, payload: bytes) -> None:
        if flags & h2.ACK:
            if payload == KEEPALIVE_PING:
                self._cancel_timer("keepalive-timeout")
            elif payload == GOAWAY_PING and self._goaway_state == 1:
                self._final_goaway()
            return
        # gRPC's ping abuse policy: a client pinging more often than allowed earns strikes
        keepalive = self._keepalive
        now = self.loop.time()
        idle = not self.streams
        interval = 7200.0 if idle and not keepalive.permit_without_calls else keepalive.min_recv_ping_interval
        last, self._last_ping_received = self._last_ping_received, now
        if last is not None and last + interval > now:
            self._ping_strikes += 1
            if keepalive.max_ping_strikes and self._ping_strikes > keepalive.max_ping_strikes:
                self._fail(h2.ENHANCE_YOUR_CALM, "too_many_pings")
                return
        if self._induced_frame():
            self._write(h2.frame(h2.PING, h2.ACK, 0, payload))

    def _keepalive_tick(self) -> None:
        keepalive = self._keepalive
        assert keepalive.time is not None
        self._timer("keepalive", keepalive.time, self._keepalive_tick)
        if self._read_since_ping:
            self._read_since_ping = False
            return
        if not self.streams and not keepalive.permit_without_calls:
            return
        if "keepalive-timeout" in self._timers:
            return  # the last PING is still unanswered
        if keepalive.max_pings_without_data and self._pings_without_data >= keepalive.max_pings_without_data:
            return
        self._pings_without_data += 1
        self._write(h2.frame(h2.PING, 0, 0, KEEPALIVE_PING))
        self._timer("keepalive-timeout", keepalive.timeout, self._keepalive_expired)

    def _keepalive_expired(self) -> None:
        logger.debug("gRPC client %s did not answer a keepalive ping: closing its connection", self.peer)
        self.abort()

    # -- time limits --------------------------------------------------------------------------

    def _handshake_expired(self) -> None:
        self._fail(h2.SETTINGS_TIMEOUT if self._preface else h2.PROTOCOL_ERROR, "no preface and SETTINGS in time")

    def _header_block_expired(self) -> None:
        self._fail(h2.ENHANCE_YOUR_CALM, "a header block was not finished in time")

    def _age_reached(self) -> None:
        self.shutdown()
        grace = self._keepalive.max_connection_age_grace
        if grace is not None:
            self._timer("age-grace", grace, self.abort)

    def _housekeeping(self) -> None:
        """Idle connections asked to go; streams whose answers have stalled reset."""
        self._timer("housekeeping", HOUSEKEEPING_SECONDS, self._housekeeping)
        now = self.loop.time()
        if self._idle_since is not None and now - self._idle_since >= IDLE_SECONDS:
            self._idle_since = None
            self.shutdown()
        for stream in list(self._blocked.values()):
            since = stream.blocked_since
            if since is not None and now - since >= STALL_SECONDS:
                logger.debug("gRPC client %s: stream %d waited %.0f s for window: reset", self.peer, stream.id, now - since)
                self._stall_reset(stream)

    def _timer(self, name: str, delay: float, callback: Any) -> None:
        previous = self._timers.pop(name, None)
        if previous is not None:
            previous.cancel()
        if not self.closed:
            self._timers[name] = self.loop.call_later(delay, callback)

    def _cancel_timer(self, name: str) -> None:
        timer = self._timers.pop(name, None)
        if timer is not None:
            timer.cancel()


__all__ = [
    "GOAWAY_PING", "HANDSHAKE_SECONDS", "IDLE_SECONDS", "KEEPALIVE_PING", "MAX_INDUCED_FRAMES", "MAX_UNFINISHED_HEADER_BYTES",
    "RESET_BURST",
    "STALL_SECONDS", "ConnectionGuard", "Keepalive",
]
