"""The link between a frontend worker process and the model side: framed messages over
a Unix socket pair the model side made.

A frame is a 4-byte little-endian length and a pickled list of messages: those sent in one
turn of the event loop, pickled and written together at its end. A message is a tuple whose
first item names it. Pickle is safe here, unlike in the Python-model transport (:mod:`quiver.ipc`): both
ends are the server's own processes, started from the same installation by the model side,
and no client or model code writes to this socket; what a client sent arrives as the values
the worker decoded (arrays, strings), never as something that is unpickled.

Model side -> worker, first: ``("setup", {"grpc": GrpcWorkerSetup | None, "sagemaker":
SageMakerSettings | None})``.
Worker -> model side: ``("ready", pid)``, ``("infer", id, request, decoupled_error)``,
``("stream", id, request)`` (ModelStreamInfer; a request or response in these messages is
packed by :mod:`quiver.frontends.link_codec`), ``("cancel", id)``, ``("forward", id,
scope, body, app)`` (an HTTP request that is not an inference, for the model side's "http" or
"sagemaker" application), ``("rpc", id, method, request bytes, metadata)`` (a gRPC call that
is not an inference), ``("sagemaker-model", id, route, value)`` (the model a SageMaker
inference runs on).
Model side -> worker: ``("ok", id, response, queues)``, ``("error", id, code,
message[, capacity])`` (an :class:`~quiver.errors.ErrorCode` name), ``("http", id, status,
headers, body)`` (or, for an answer sent in parts, ``("http-start", id, status, headers,
first part)`` then ``("http-chunk", id, part, more)`` each; part None: the answer broke off), ``("rpc-ok", id, reply bytes)``, ``("rpc-error", id, grpc status name,
message)``, ``("value", id, value)``; for a stream ``("opened", id, decoupled)``, then
``("item", id, response | None, (code, message) | None, final)`` each, then
``("end", id)`` or ``("error", ...)``.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from collections.abc import Callable
from typing import Any

_LENGTH = struct.Struct("<I")
#: A frame past this is a broken peer (inference bodies are bounded by --http-max-input-size).
MAX_FRAME = 1 << 31
#: A frame up to this size is written as one joined bytes object, a larger one as two parts.
_JOIN_UP_TO = 1 << 16


class Link(asyncio.Protocol):
    """One end: ``send(message)``; ``on_message(message)`` for each message received;
    ``on_lost()`` once when the other end is gone.

    Messages sent in one turn of the event loop go out together at its end, one pickled list
    in one frame and one system call: with many requests in flight, one wake-up of the other
    end carries several of them, and each costs the pickling of a list item, not of a frame."""

    def __init__(self, on_message: Callable[[tuple[Any, ...]], None], on_lost: Callable[[], None]) -> None:
        self.on_message = on_message
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._outgoing: list[tuple[Any, ...]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, message: tuple[Any, ...]) -> None:
        outgoing = self._outgoing
        outgoing.append(message)
        if len(outgoing) == 1:
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        outgoing, self._outgoing = self._outgoing, []
        transport = self.transport
        if not outgoing or self.closed or transport is None or transport.is_closing():
            return
        body = pickle.dumps(outgoing, protocol=pickle.HIGHEST_PROTOCOL)
        if len(body) <= _JOIN_UP_TO:
            transport.write(_LENGTH.pack(len(body)) + body)
        else:
            transport.writelines((_LENGTH.pack(len(body)), body))

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        if buffer:
            buffer += data
            data = buffer  # type: ignore[assignment]
        offset = 0
        size = len(data)
        on_message = self.on_message
        while size - offset >= 4:
            (length,) = _LENGTH.unpack_from(data, offset)
            if length > MAX_FRAME:
                self.close()
                return
            end = offset + 4 + length
            if end > size:
                break
            messages = pickle.loads(memoryview(data)[offset + 4 : end])
            offset = end
            for message in messages:
                on_message(message)
        if data is buffer:
            del buffer[:offset]
        elif offset < size:
            buffer += memoryview(data)[offset:]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed:
            self.closed = True
            self.on_lost()

    def close(self) -> None:
        if self.transport is not None:
            if self._outgoing:
                self._flush()
            self.transport.close()


__all__ = ["Link"]
