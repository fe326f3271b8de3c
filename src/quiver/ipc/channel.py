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
import socket
import struct
import threading
from typing import Any

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


def encode(message: dict[str, Any]) -> bytes:
    if _orjson is not None:
        try:
            body: bytes = _orjson.dumps(message)
        except TypeError:  # what orjson does not take (integers over 64 bits): the exact way
            pass
        else:
            # orjson writes a non-finite float as null: such a message goes the exact way
            if b"null" not in body or not _non_finite(message):
                return _LENGTH.pack(len(body)) + body
    body = json.dumps(message, separators=(",", ":")).encode("utf-8")
    return _LENGTH.pack(len(body) | _EXACT) + body


def _non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_non_finite(item) for item in value.values())
    if isinstance(value, list | tuple):
        return any(_non_finite(item) for item in value)
    return False


def _length(head: bytes) -> tuple[int, bool]:
    """A frame's body length and whether it must be read with the standard library's json."""
    (word,) = _LENGTH.unpack(head)
    length = word & ~_EXACT
    if length > MAX_FRAME:
        raise ChannelError(f"a frame of {length} bytes (at most {MAX_FRAME})")
    return length, bool(word & _EXACT)


def decode(body: bytes, exact: bool = False) -> dict[str, Any]:
    try:
        message = _orjson.loads(body) if _orjson is not None and not exact else json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ChannelError(f"a message that is not JSON: {exc}") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
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

    def send(self, message: dict[str, Any]) -> None:
        frame = encode(message)
        with self._send_lock:
            self.sock.sendall(frame)

    def send_many(self, messages: list[dict[str, Any]]) -> None:
        """Several messages in one write (the peer reads them one by one)."""
        frames = b"".join(encode(message) for message in messages)
        with self._send_lock:
            self.sock.sendall(frames)

    def recv(self) -> dict[str, Any] | None:
        """The next message; None when the peer closed the channel."""
        head = self._read(4)
        if head is None:
            return None
        length, exact = _length(head)
        body = self._read(length)
        return None if body is None else decode(body, exact)

    def _read(self, size: int) -> bytes | None:
        """Exactly ``size`` bytes; None at the end of the stream."""
        if self._buffered:
            buffer = self._buffer
            while len(buffer) < size:
                try:
                    chunk = self.sock.recv(max(1 << 16, size - len(buffer)))
                except ConnectionError:
                    return None
                if not chunk:
                    return None
                buffer += chunk
            data = bytes(buffer[:size])
            del buffer[:size]
            return data
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


class AsyncChannel:
    """Messages over ``sock`` on the running asyncio loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sock: socket.socket) -> None:
        self._reader = reader
        self._writer = writer
        self._sock = sock
        self._loop = asyncio.get_running_loop()

    @classmethod
    async def open(cls, sock: socket.socket) -> AsyncChannel:
        sock.setblocking(False)
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MAX_FRAME + 4)
        return cls(reader, writer, sock)

    def send(self, message: dict[str, Any]) -> None:
        """Queue ``message`` (the loop writes it; never blocks)."""
        if not self._writer.is_closing():
            self._writer.write(encode(message))

    async def recv(self) -> dict[str, Any] | None:
        try:
            head = await self._reader.readexactly(4)
            length, exact = _length(head)
            body = await self._reader.readexactly(length)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        return decode(body, exact)

    def close(self) -> None:
        """Close from any thread (on the channel's loop when it still runs)."""
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._writer.close()
        elif not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._writer.close)
            except RuntimeError:  # closed meanwhile
                self._close_socket()
        else:
            self._close_socket()

    def _close_socket(self) -> None:
        self._sock.close()
