"""The request bytes of Quiver's gRPC calls, held until their handlers take them, and the budget
that bounds them.

A call's received bytes stay raw in one buffer (:class:`RequestBuffer`); a message is cut out
when the handler takes it (a streaming request's messages one by one, as its reader asks), so
a client sending many small messages costs what it sent, not an object per message.

The server's :class:`ReceiveBudget` bounds the request bytes calls hold, in all and per
connection. A message is admitted once its length is known and the budget has room for all of
it: its whole size is reserved then, and its stream's window opened for all of it, so admitted
messages always finish and several large uploads never starve each other halfway. Until then
its call may hold no more than a stream window (HTTP/2's 64 KiB) and its client waits. A
stream's window comes back to 64 KiB as its handler takes what came, not before (a stream whose
reader is behind stops its client). While the budget is spent, new streams are refused
(REFUSED_STREAM, which clients retry), so are calls whose bytes arrive with no room for them
(streams opened before it was spent, on however many connections: a stream's window is not a
promise of room), and a message that makes no progress for :data:`PROGRESS_SECONDS` ends its call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from quiver.frontends.http2 import Http2Connection, Stream

#: A request message with bytes missing and none arriving for this long ends its call.
PROGRESS_SECONDS = 30.0
_PREFIX = 5  # a message's compressed flag and 4-byte length
#: Credit past what an admitted message still needs: the most one frame's padding takes (its
#: length byte and 255 bytes), so a client that pads its DATA can always send the rest.
PADDING_ROOM = 256


class ReceiveBudget:
    """Request bytes received and not yet taken by a handler: server-wide and per connection.

    Messages waiting for room are looked at again once per turn of the event loop in which some
    was freed, in the order they came, each connection's up to the first that still does not
    fit: the work is in proportion to the messages admitted and the connections waiting, not to
    every waiting message for every call that ends."""

    def __init__(self, limit: int, per_connection: int) -> None:
        self.limit = limit
        self.per_connection = per_connection
        self.used = 0
        self._starved: dict[Http2Connection, dict[RequestBuffer, None]] = {}
        self._waking = False

    def room(self, connection: Http2Connection) -> bool:
        return self.used < self.limit and connection.buffered < self.per_connection

    def fits(self, connection: Http2Connection, charge: int, now: int) -> bool:
        """Whether a buffer counting ``now`` may count ``charge``: in all and in its
        connection's share, or when nothing else is held (a message is at most half the budget)."""
        if charge <= now or self.used == now:
            return True
        more = charge - now
        return self.used + more <= self.limit and connection.buffered + more <= self.per_connection

    def adjust(self, connection: Http2Connection, delta: int) -> None:
        self.used += delta
        connection.buffered += delta
        if delta < 0 and self._starved and not self._waking:
            self._waking = True
            connection.loop.call_soon(self._wake)

    def _wake(self) -> None:
        self._waking = False
        for connection, waiting in list(self._starved.items()):
            while waiting and self.used < self.limit:
                buffer = next(iter(waiting))
                buffer.credit()  # admitted: it leaves the queue; still no room: it stays first
                if buffer in waiting:
                    break
            if not waiting:
                self._starved.pop(connection, None)

    def starve(self, buffer: RequestBuffer) -> None:
        self._starved.setdefault(buffer.connection, {})[buffer] = None

    def forget(self, buffer: RequestBuffer) -> None:
        waiting = self._starved.get(buffer.connection)
        if waiting is not None:
            waiting.pop(buffer, None)
            if not waiting:
                del self._starved[buffer.connection]


class RequestBuffer:
    """One call's request bytes not yet taken (see the module's docstring)."""

    __slots__ = ("_admitted", "_budget", "_charge", "_data", "_start", "_stream", "connection")

    def __init__(self, budget: ReceiveBudget, connection: Http2Connection, stream: Stream) -> None:
        self._budget = budget
        self.connection = connection
        self._stream = stream
        self._data = bytearray()
        self._start = 0  # where the untaken bytes begin
        self._admitted = 0  # the whole size of the head message once admitted, else 0
        self._charge = 0  # what this buffer counts in the budget

    def _recharge(self) -> None:
        charge = max(self.pending(), self._admitted)
        if charge != self._charge:
            delta, self._charge = charge - self._charge, charge
            self._budget.adjust(self.connection, delta)

    def add(self, data: memoryview) -> bool:
        """Keep ``data``; False (nothing kept) when it is not part of an admitted message and
        the server-wide budget has no room for it (unless nothing else is held)."""
        charge = max(self.pending() + len(data), self._admitted)
        budget = self._budget
        if charge > self._charge and budget.used + charge - self._charge > budget.limit and budget.used != self._charge:
            return False
        self._data += data
        self._recharge()
        return True

    def pending(self) -> int:
        return len(self._data) - self._start

    def head(self) -> tuple[int, int] | None:
        """(flag, length) of the message at the head, once its prefix is here."""
        data, start = self._data, self._start
        if len(data) - start < _PREFIX:
            return None
        return data[start], int.from_bytes(data[start + 1 : start + _PREFIX], "big")

    def whole(self) -> bool:
        head = self.head()
        return head is not None and self.pending() >= _PREFIX + head[1]

    def take(self) -> tuple[int, bytes]:
        """The head message, out of the buffer and the budget."""
        head = self.head()
        assert head is not None
        flag, length = head
        start, end = self._start + _PREFIX, self._start + _PREFIX + length
        message = bytes(self._data[start:end])
        self._start = end
        if self._start == len(self._data):
            self._data.clear()
            self._start = 0
        elif self._start > 65536 and self._start > len(self._data) // 2:
            del self._data[: self._start]
            self._start = 0
        self._admitted = 0
        self._recharge()
        return flag, message

    def credit(self) -> None:
        """Open the stream's window as far as the head message needs: for all of it once the
        budget has room (admitted), back to a stream window when nothing whole waits; none
        while a whole message waits for the reader or the budget has no room."""
        head = self.head()
        if head is None or self.whole():
            self._budget.forget(self)
            if head is None:
                self.connection.top_up(self._stream)
            return  # (a whole message: the reader has it to take first)
        need = _PREFIX + head[1]
        if not self._admitted:
            if not self._budget.fits(self.connection, max(self.pending(), need), self._charge):
                self._budget.starve(self)
                return
            self._admitted = need
            self._recharge()
        self._budget.forget(self)
        self.connection.top_up(self._stream, need - self.pending() + PADDING_ROOM)

    def release(self) -> None:
        """The call has ended: what it held leaves the budget."""
        self._budget.forget(self)
        self._admitted = 0
        if self._charge:
            self._budget.adjust(self.connection, -self._charge)
            self._charge = 0
        self._data = bytearray()
        self._start = 0


__all__ = ["PROGRESS_SECONDS", "ReceiveBudget", "RequestBuffer"]
