"""The control channel: length-prefixed JSON messages over a pair of pipes (one each way).

A frame is a 4-byte little-endian length and that many bytes of UTF-8 JSON (an object with an
``op`` key, :mod:`quiver.ipc.messages`), written and read with orjson where it is installed
(else the standard library's json: a worker may run under a Python without it). Frames larger than ``MAX_FRAME`` are refused: tensors
never travel here, so a huge frame is a broken or hostile peer. :class:`Channel` is the blocking
end (a worker; the server's start-up handshake); :class:`AsyncChannel` reads and writes on an
asyncio loop (the server once a worker serves).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib
import json
import math
import os
import select
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
#: What each pipe holds before a writer waits for its reader (Linux's default is 64 KiB).
PIPE_BYTES = 256 << 10
_LENGTH = struct.Struct("<I")
#: Frames shorter than this are decoded from a copy of their bytes (orjson reads bytes faster
#: than a memoryview of them), longer ones from a view.
_COPY_BELOW = 4096
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
            if body.find(b"null") < 0 or not _non_finite(value):  # find(): see encode()
                return body, False
    return json.dumps(value, separators=(",", ":"), default=default).encode("utf-8"), True


def encode(message: dict[str, Any]) -> bytes:
    if _orjson is not None:  # the usual way, as dumps() takes it
        try:
            body: bytes = _orjson.dumps(message)
        except TypeError:
            pass
        else:
            # find(), not ``in`` (which tries the operand as an integer first, raising and
            # clearing a TypeError each time)
            if body.find(b"null") < 0 or not _non_finite(message):
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


def pipe_pair() -> tuple[tuple[int, int], tuple[int, int]]:
    """Two one-way pipes joining two ends: ``(ours, theirs)``, each ``(read_fd, write_fd)``
    (not inheritable: hand ``theirs`` to a child with ``pass_fds``, then close them here).

    Pipes rather than a socket pair: a thread blocked reading a pipe is woken only by input
    (a pipe's readers and writers wait on separate queues), so a blocking read needs no
    ``poll()`` before it, and a pipe's write and read cost less than a socket's."""
    ours_read, theirs_write = os.pipe()
    theirs_read, ours_write = os.pipe()
    for fd in (ours_write, theirs_write):  # room for a large message, as a socket's buffer has
        with contextlib.suppress(OSError, AttributeError):
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    return (ours_read, ours_write), (theirs_read, theirs_write)


def write_all(fd: int, data: bytes) -> None:
    """All of ``data`` into the blocking ``fd`` (a write to a pipe may take part of it)."""
    written = os.write(fd, data)
    if written < len(data):
        with memoryview(data) as view:
            while written < len(data):
                written += os.write(fd, view[written:])


class Channel:
    """Blocking messages over a pair of pipes ``fds`` (read, write), which it owns; ``send``
    may be called from any thread, ``recv``/``receive`` from one at a time. ``buffered`` reads
    ahead (one system call per message or fewer), for an end that never hands its pipes over;
    unbuffered reads take exactly one message's bytes."""

    def __init__(self, fds: tuple[int, int], *, buffered: bool = False) -> None:
        self.fds = fds
        self._read_fd, self._write_fd = fds
        self._send_lock = threading.Lock()
        self._buffered = buffered
        #: Bytes read ahead and not yet returned as messages (a buffered channel): while it
        #: holds any, the next :meth:`receive` may return without reading.
        self.buffer = bytearray()
        self._poller: select.poll | None = None
        self._closed = False

    def send(self, message: dict[str, Any]) -> None:
        frame = encode(message)
        with self._send_lock:
            written = os.write(self._write_fd, frame)
            if written < len(frame):  # a pipe may take a large frame in parts
                write_all(self._write_fd, frame[written:])

    def send_many(self, messages: list[dict[str, Any]]) -> None:
        """Several messages in one write (the peer reads them one by one)."""
        frames = b"".join([encode(message) for message in messages])
        with self._send_lock:
            write_all(self._write_fd, frames)

    def recv(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next message; None when the peer closed the channel; TimeoutError when none
        came within ``timeout`` seconds (None: as long as it takes)."""
        if self._buffered:
            message = self.receive(timeout)
            if isinstance(message, _Empty):
                raise TimeoutError(f"no message within {timeout} s")
            return message
        deadline = None if timeout is None else time.monotonic() + timeout
        head = self._read(4, deadline)
        if head is None:
            return None
        length, exact = _length(head)
        body = self._read(length, deadline)
        return None if body is None else decode(body, exact)

    def _readable(self, timeout: float | None) -> bool:
        """Whether input (or the end of the pipe) came within ``timeout`` seconds."""
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(self._read_fd, select.POLLIN)
        return bool(self._poller.poll(None if timeout is None else max(0.0, timeout) * 1000))

    def receive(self, timeout: float | None) -> dict[str, Any] | _Empty | None:
        """The next message of a buffered channel, waiting at most ``timeout`` seconds (0: only
        what has arrived; None: as long as it takes): :data:`EMPTY` when no whole message came
        in time, None when the peer closed the channel."""
        assert self._buffered, "receive() reads ahead: a buffered channel only"
        buffer = self.buffer
        if timeout is None and not buffer:  # the usual: wait for the next message, read it whole
            try:
                chunk = os.read(self._read_fd, 1 << 16)  # woken by input only (see pipe_pair)
            except OSError:  # closed under us
                return None
            if len(chunk) >= 4:
                (word,) = _LENGTH.unpack_from(chunk)
                length = word & ~_EXACT
                if len(chunk) == 4 + length and length < _COPY_BELOW and not word & _EXACT and _orjson is not None:
                    try:
                        message = _orjson.loads(chunk[4:])
                    except ValueError as exc:
                        raise ChannelError(f"a message that is not JSON: {exc}") from None
                    if type(message) is not dict or type(message.get("op")) is not str:
                        raise ChannelError("a message that is not an object with an 'op'")
                    return message
            elif not chunk:
                return None
            buffer += chunk  # a part, several or a large one: the general way
        return self._receive(timeout)

    def _receive(self, timeout: float | None) -> dict[str, Any] | _Empty | None:
        buffer = self.buffer
        deadline = None if timeout is None else time.monotonic() + timeout
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
            # Without a deadline the read itself waits (woken by input only: see pipe_pair);
            # with one, poll() waits until input comes or the deadline passes.
            if deadline is not None and not self._readable(deadline - time.monotonic()):
                return EMPTY
            try:
                chunk = os.read(self._read_fd, 1 << 16)
            except OSError:  # closed under us
                return None
            if not chunk:
                return None
            if not buffer and len(chunk) >= 4:
                (word,) = _LENGTH.unpack_from(chunk)
                length = word & ~_EXACT
                if len(chunk) == 4 + length and length <= MAX_FRAME:
                    # one whole message, decoded where it was read
                    return decode(chunk[4:] if length < _COPY_BELOW else memoryview(chunk)[4:], bool(word & _EXACT))
            buffer += chunk

    def _read(self, size: int, deadline: float | None) -> bytes | None:
        """Exactly ``size`` bytes; None at the end of the stream (an unbuffered channel)."""
        chunks = []
        while size:
            if deadline is not None and not self._readable(deadline - time.monotonic()):
                raise TimeoutError("no message in time")
            try:
                chunk = os.read(self._read_fd, size)
            except OSError:
                return None
            if not chunk:
                return None
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for fd in self.fds:
                with contextlib.suppress(OSError):
                    os.close(fd)


class AsyncChannel(asyncio.Protocol):
    """Messages over a pair of pipes on the running asyncio loop: each message that arrives is
    handed to ``deliver`` on the loop, in order, as soon as its bytes are read (no task per
    message); ``ended(error)`` runs once when the channel ends (None: the peer closed it; else
    what was wrong with what the peer sent: nothing more is delivered)."""

    def __init__(self, deliver: Callable[[dict[str, Any]], None], ended: Callable[[Exception | None], None]) -> None:
        self._deliver = deliver
        self._ended: Callable[[Exception | None], None] | None = ended
        self._buffer = bytearray()
        self._transport: asyncio.ReadTransport | None = None
        self._writer: asyncio.WriteTransport | None = None
        self._read_fd = -1
        self._fds: tuple[int, int] | None = None  # until the transports own them
        self._loop = asyncio.get_running_loop()

    @classmethod
    async def open(
        cls, fds: tuple[int, int], deliver: Callable[[dict[str, Any]], None], ended: Callable[[Exception | None], None]
    ) -> AsyncChannel:
        """The channel over ``fds`` (read, write), which it owns from now on."""
        loop = asyncio.get_running_loop()
        channel = cls(deliver, ended)
        channel._fds = fds
        # the writing end first: a message delivered at once may be answered at once
        writer, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(fds[1], "wb", buffering=0))
        channel._writer = writer
        channel._read_fd = fds[0]
        channel._fds = None
        await loop.connect_read_pipe(lambda: channel, os.fdopen(fds[0], "rb", buffering=0))
        return channel

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.ReadTransport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        if not buffer and len(data) >= 4 and _orjson is not None and self._ended is not None:
            # The usual: one whole small message (an answer), read at once; decoded here
            # without the general loop (its ``exact`` bit makes the length too large to match).
            (word,) = _LENGTH.unpack_from(data)
            if word < _COPY_BELOW and len(data) == word + 4:
                try:
                    try:
                        message = _orjson.loads(data[4:])
                    except ValueError as exc:  # orjson's JSONDecodeError (UTF-8 errors included)
                        raise ChannelError(f"a message that is not JSON: {exc}") from None
                    if type(message) is not dict or type(message.get("op")) is not str:
                        raise ChannelError("a message that is not an object with an 'op'")
                    self._deliver(message)
                except (ChannelError, AttributeError, LookupError, TypeError, ValueError) as exc:  # a broken peer
                    self._end(exc)
                    if self._transport is not None:
                        self._transport.close()
                return
        if buffer:
            buffer += data
            data = bytes(buffer)
            del buffer[:]
        # Whole frames are decoded straight out of what was read; the rest waits in the buffer.
        size = len(data)
        start = 0
        deliver = self._deliver
        try:
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
                body = data[start + 4 : end] if length < _COPY_BELOW else memoryview(data)[start + 4 : end]
                start = end
                deliver(decode(body, bool(word & _EXACT)))
        except (ChannelError, AttributeError, LookupError, TypeError, ValueError) as exc:  # a broken peer
            self._end(exc)
            if self._transport is not None:
                self._transport.close()
            return
        if start < size:
            buffer += data[start:]

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(None)

    def _end(self, error: Exception | None) -> None:
        ended, self._ended = self._ended, None
        if ended is not None:
            ended(error)

    def send(self, message: dict[str, Any]) -> None:
        """Queue ``message`` (the loop writes it; never blocks)."""
        writer = self._writer
        if writer is not None and not writer.is_closing():
            writer.write(encode(message))

    def close(self) -> None:
        """Close from any thread (on the channel's loop when it still runs)."""
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        transports: list[asyncio.BaseTransport] = [t for t in (self._transport, self._writer) if t is not None]
        if running is self._loop:
            self._close(transports)
        elif not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._close, transports)
            except RuntimeError:  # closed meanwhile
                self._close_fds()
        else:
            self._close_fds()

    def _close(self, transports: list[asyncio.BaseTransport]) -> None:
        for transport in transports:
            transport.close()
        self._close_fds()

    def _close_fds(self) -> None:
        """The pipes no transport took over (the loop had ended before it could)."""
        fds, self._fds = self._fds, None
        for fd in fds or ():
            with contextlib.suppress(OSError):
                os.close(fd)
