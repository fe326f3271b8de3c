"""The control channel: length-prefixed JSON messages over a connected Unix socket.

A frame is a 4-byte little-endian length and that many bytes of UTF-8 JSON (an object with an
``op`` key, :mod:`quiver.ipc.messages`), written and read with orjson where it is installed
(else the standard library's json: a worker may run under a Python without it). Frames larger than ``MAX_FRAME`` are refused: tensors
never travel here, so a huge frame is a broken or hostile peer. :class:`Channel` is the blocking
end (a worker; the server's start-up handshake); :class:`AsyncChannel` reads and writes on an
asyncio loop (the server once a worker serves).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, Final, cast

_orjson: Any
try:  # faster where installed; a worker under a foreign Python may not have it (then json)
    _orjson = importlib.import_module("orjson")
except ImportError:  # pragma: no cover - depends on the interpreter
    _orjson = None

MAX_FRAME = 64 << 20
_LENGTH = struct.Struct("<I")
#: Set in a frame's length word when its JSON holds what orjson would not carry exactly
#: (integers over 64 bits, NaN and infinities): the reader then uses the standard library's
#: json, which reads them back as they were.
_EXACT = 1 << 31


class ChannelError(Exception):
    """The peer sent something that is not a message."""


class _Empty:
    def __repr__(self) -> str:
        return "EMPTY"


#: What :meth:`Channel.receive` answers when no whole message arrived in time.
EMPTY: Final = _Empty()


def dumps(value: Any, default: Callable[[Any], Any] | None = None) -> tuple[bytes, bool]:
    """``value`` as compact UTF-8 JSON, and whether it took the standard library's json (which
    alone writes integers over 64 bits, NaN and infinities as they are; orjson otherwise)."""
    if _orjson is not None:
        try:
            body: bytes = _orjson.dumps(value, default=default)
        except TypeError:  # what orjson does not take (integers over 64 bits): the exact way
            pass
        else:
            # orjson writes a non-finite float as null: such a value goes the exact way
            if b"null" not in body or not _non_finite(value):
                return body, False
    return json.dumps(value, separators=(",", ":"), default=default).encode("utf-8"), True


def encode(message: dict[str, Any]) -> bytes:
    if _orjson is not None:  # the usual way, as dumps() takes it
        try:
            body: bytes = _orjson.dumps(message)
        except TypeError:
            pass
        else:
            if b"null" not in body or not _non_finite(message):
                return _LENGTH.pack(len(body)) + body
    body, exact = dumps(message)
    return _LENGTH.pack(len(body) | _EXACT if exact else len(body)) + body


def _non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_non_finite(item) for item in value.values())
    if isinstance(value, list | tuple):
        return any(_non_finite(item) for item in value)
    return False


def _length(head: bytes | bytearray) -> tuple[int, bool]:
    """A frame's body length and whether it must be read with the standard library's json."""
    (word,) = _LENGTH.unpack(head)
    length = word & ~_EXACT
    if length > MAX_FRAME:
        raise ChannelError(f"a frame of {length} bytes (at most {MAX_FRAME})")
    return length, bool(word & _EXACT)


def decode_json(body: str | bytes | bytearray | memoryview, exact: bool = False) -> Any:
    """JSON text as Python values (orjson unless ``exact``); ChannelError when it is not JSON."""
    try:
        if _orjson is not None and not exact:
            return _orjson.loads(body)
        return json.loads(bytes(body) if isinstance(body, memoryview) else body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ChannelError(f"a message that is not JSON: {exc}") from None


def decode(body: bytes | bytearray | memoryview, exact: bool = False) -> dict[str, Any]:
    if _orjson is not None and not exact:
        try:
            message = _orjson.loads(body)
        except ValueError as exc:  # orjson's JSONDecodeError (UTF-8 errors included)
            raise ChannelError(f"a message that is not JSON: {exc}") from None
    else:
        message = decode_json(body, exact)
    if type(message) is not dict or type(message.get("op")) is not str:
        raise ChannelError("a message that is not an object with an 'op'")
    return message


class Channel:
    """Blocking messages over ``sock``; ``send`` may be called from any thread, ``recv`` from
    one. ``buffered`` reads ahead (one system call per message or fewer), for an end that never
    hands its socket over; unbuffered reads take exactly one message's bytes."""

    def __init__(self, sock: socket.socket, *, buffered: bool = False) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self._buffered = buffered
        self._buffer = bytearray()
        self._poller: select.poll | None = None

    def send(self, message: dict[str, Any]) -> None:
        frame = encode(message)
        with self._send_lock:
            self.sock.sendall(frame)

    def send_many(self, messages: list[dict[str, Any]]) -> None:
        """Several messages in one write (the peer reads them one by one)."""
        frames = b"".join([encode(message) for message in messages])
        with self._send_lock:
            self.sock.sendall(frames)

    def recv(self) -> dict[str, Any] | None:
        """The next message; None when the peer closed the channel."""
        if self._buffered:
            message = self.receive(None)
            assert not isinstance(message, _Empty)
            return message
        head = self._read(4)
        if head is None:
            return None
        length, exact = _length(head)
        body = self._read(length)
        return None if body is None else decode(body, exact)

    def receive(self, timeout: float | None) -> dict[str, Any] | _Empty | None:
        """The next message of a buffered channel, waiting at most ``timeout`` seconds (0: only
        what has arrived; None: as long as it takes): :data:`EMPTY` when no whole message came
        in time, None when the peer closed the channel."""
        assert self._buffered, "receive() reads ahead: a buffered channel only"
        buffer = self._buffer
        deadline: float | None = None
        # A wait that may block polls before it reads: at one call at a time its input has
        # not come yet, and a read that finds nothing costs more (an exception) than a poll()
        # that returns at once when it has.
        ready = timeout == 0
        while True:
            if len(buffer) >= 4:
                (word,) = _LENGTH.unpack_from(buffer)
                length = word & ~_EXACT
                if length > MAX_FRAME:
                    raise ChannelError(f"a frame of {length} bytes (at most {MAX_FRAME})")
                end = 4 + length
                if len(buffer) >= end:
                    body = buffer[4:end]
                    del buffer[:end]
                    return decode(body, bool(word & _EXACT))
            if not ready:
                # Sleep in poll() for input, never in a blocking recv(). A thread blocked in
                # recv() is also woken each time the peer reads what this end sent (the
                # socket's wait queue is shared with writers waiting for room), and on a
                # virtual machine such a needless wake-up costs more than a small call.
                if self._poller is None:
                    self._poller = select.poll()
                    self._poller.register(self.sock.fileno(), select.POLLIN)
                if timeout is None:
                    self._poller.poll()
                else:
                    if deadline is None:
                        deadline = time.monotonic() + timeout
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or not self._poller.poll(remaining * 1000):
                        return EMPTY
            try:
                chunk = self.sock.recv(1 << 16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if timeout == 0:
                    return EMPTY
                ready = False  # woken for nothing: wait again
                continue
            except ConnectionError:
                return None
            if not chunk:
                return None
            if not buffer and len(chunk) >= 4:
                (word,) = _LENGTH.unpack_from(chunk)
                length = word & ~_EXACT
                if len(chunk) == 4 + length and length <= MAX_FRAME:
                    # the usual: one whole message, decoded where it was read
                    return decode(memoryview(chunk)[4:], bool(word & _EXACT))
            buffer += chunk
            ready = True  # a frame cut short: the rest is most likely on its way

    def _read(self, size: int) -> bytes | None:
        """Exactly ``size`` bytes; None at the end of the stream (an unbuffered channel)."""
        buffer = bytearray(size)
        view = memoryview(buffer)
        got = 0
        while got < size:
            try:
                n = self.sock.recv_into(view[got:])
            except ConnectionError:
                return None
            if n == 0:
                return None
            got += n
        return bytes(buffer)

    def close(self) -> None:
        self.sock.close()


class AsyncChannel(asyncio.Protocol):
    """Messages over ``sock`` on the running asyncio loop: each message that arrives is handed to
    ``deliver`` on the loop, in order, as soon as its bytes are read (no task per message);
    ``ended(error)`` runs once when the channel ends (None: the peer closed it; else what was
    wrong with what the peer sent: nothing more is delivered). :meth:`poll` reads what has
    arrived without waiting for the loop, for a caller that expects an answer any moment."""

    def __init__(self, deliver: Callable[[dict[str, Any]], None], ended: Callable[[Exception | None], None]) -> None:
        self._deliver = deliver
        self._ended: Callable[[Exception | None], None] | None = ended
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._sock: socket.socket | None = None
        self._loop = asyncio.get_running_loop()

    @classmethod
    async def open(
        cls, sock: socket.socket, deliver: Callable[[dict[str, Any]], None], ended: Callable[[Exception | None], None]
    ) -> AsyncChannel:
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        _, channel = await loop.create_unix_connection(lambda: cls(deliver, ended), sock=sock)
        channel._sock = sock
        return channel

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        if buffer:
            buffer += data
            data = bytes(buffer)
            del buffer[:]
        # Whole frames are decoded straight out of what was read; the rest waits in the buffer.
        size = len(data)
        start = 0
        try:
            with memoryview(data) as view:
                while size - start >= 4:
                    if self._ended is None:
                        return
                    (word,) = _LENGTH.unpack_from(data, start)
                    length = word & ~_EXACT
                    if length > MAX_FRAME:
                        raise ChannelError(f"a frame of {length} bytes (at most {MAX_FRAME})")
                    end = start + 4 + length
                    if size < end:
                        break
                    message = decode(view[start + 4 : end], bool(word & _EXACT))
                    start = end
                    self._deliver(message)
        except (ChannelError, KeyError, TypeError, ValueError) as exc:
            self._end(exc)
            if self._transport is not None:
                self._transport.abort()
            return
        if start < size:
            buffer += data[start:]

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(None)

    def _end(self, error: Exception | None) -> None:
        ended, self._ended = self._ended, None
        if ended is not None:
            ended(error)

    def poll(self) -> None:
        """Read and deliver what has arrived, now (on the loop's thread; never waits)."""
        sock = self._sock
        if sock is None or self._ended is None:
            return
        try:
            data = sock.recv(1 << 16, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return  # the transport sees it too, and ends the channel
        if data:
            self.data_received(data)

    def send(self, message: dict[str, Any]) -> None:
        """Queue ``message`` (the loop writes it; never blocks)."""
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.write(encode(message))

    def close(self) -> None:
        """Close from any thread (on the channel's loop when it still runs)."""
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        transport = self._transport
        if transport is None:
            self._close_socket()
        elif running is self._loop:
            transport.close()
        elif not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(transport.close)
            except RuntimeError:  # closed meanwhile
                self._close_socket()
        else:
            self._close_socket()

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
