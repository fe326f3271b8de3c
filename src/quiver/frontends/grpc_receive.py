"""The request bytes of Quiver's gRPC calls, held until their handlers take them, and the budget
that bounds them.

A call's received bytes stay raw in one buffer (:class:`RequestBuffer`); a message is cut out
when the handler takes it (a streaming request's messages one by one, as its reader asks), so
a client sending many small messages costs what it sent, not an object per message. Credit
(HTTP/2 WINDOW_UPDATE) goes back to the client for bytes the handler took, and for the bytes
of the message at the head of the buffer while it is incomplete, so it can finish, but only
while the server's :class:`ReceiveBudget` has room: request bytes held by all calls, and by the
calls of one connection, each have a ceiling. A call past it gets no credit (its client waits)
until another call's handler takes its bytes or a call ends; meanwhile new streams are refused
(REFUSED_STREAM, which clients retry), and a message that makes no progress for
:data:`PROGRESS_SECONDS` ends its call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from quiver.frontends.http2 import Http2Connection, Stream

#: A request message with bytes missing and none arriving for this long ends its call.
PROGRESS_SECONDS = 30.0
_PREFIX = 5  # a message's compressed flag and 4-byte length


class ReceiveBudget:
    """Request bytes received and not yet taken by a handler: server-wide and per connection."""

    def __init__(self, limit: int, per_connection: int) -> None:
        self.limit = limit
        self.per_connection = per_connection
        self.used = 0
        self._starved: dict[RequestBuffer, None] = {}

    def room(self, connection: Http2Connection) -> bool:
        return self.used < self.limit and connection.buffered < self.per_connection

    def add(self, connection: Http2Connection, size: int) -> None:
        self.used += size
        connection.buffered += size

    def remove(self, connection: Http2Connection, size: int) -> None:
        self.used -= size
        connection.buffered -= size
        if self._starved and self.used < self.limit:
            starved, self._starved = self._starved, {}
            for buffer in starved:
                buffer.credit()  # starves again if its connection is still past its share

    def starve(self, buffer: RequestBuffer) -> None:
        self._starved[buffer] = None

    def forget(self, buffer: RequestBuffer) -> None:
        self._starved.pop(buffer, None)


class RequestBuffer:
    """One call's request bytes not yet taken (see the module's docstring)."""

    __slots__ = ("_budget", "_connection", "_credited", "_data", "_start", "_stream")

    def __init__(self, budget: ReceiveBudget, connection: Http2Connection, stream: Stream) -> None:
        self._budget = budget
        self._connection = connection
        self._stream = stream
        self._data = bytearray()
        self._start = 0  # where the untaken bytes begin
        self._credited = 0  # of the untaken bytes, how many were given back as credit

    def add(self, data: memoryview) -> None:
        self._data += data
        self._budget.add(self._connection, len(data))

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
        """The head message, out of the buffer: its bytes leave the budget and go back as
        credit (those not given back already)."""
        head = self.head()
        assert head is not None
        flag, length = head
        start, end = self._start + _PREFIX, self._start + _PREFIX + length
        message = bytes(self._data[start:end])
        size = _PREFIX + length
        self._start = end
        if self._start == len(self._data):
            self._data.clear()
            self._start = 0
        elif self._start > 65536 and self._start > len(self._data) // 2:
            del self._data[: self._start]
            self._start = 0
        given = min(size, self._credited)
        self._credited -= given
        self._budget.remove(self._connection, size)
        self._connection.consume(self._stream, size - given)
        return flag, message

    def credit(self) -> None:
        """Give back credit for the head message's bytes while it is incomplete, budget allowing."""
        if self.whole():
            return
        owed = self.pending() - self._credited
        if owed <= 0:
            return
        if not self._budget.room(self._connection):
            self._budget.starve(self)
            return
        self._credited += owed
        self._connection.consume(self._stream, owed)

    def release(self) -> None:
        """The call has ended: what it held leaves the budget; the connection's window gets
        back what was never given as credit."""
        pending = self.pending()
        self._budget.forget(self)
        if pending:
            self._budget.remove(self._connection, pending)
            self._connection.discard(pending - min(pending, self._credited))
        self._data = bytearray()
        self._start = self._credited = 0


__all__ = ["PROGRESS_SECONDS", "ReceiveBudget", "RequestBuffer"]
