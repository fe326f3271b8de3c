"""An in-process HTTP/2 pair for unit tests of Quiver's server connection: the server's
``Http2Connection`` on a real event loop with an in-memory transport, and the ``h2`` package's
client connection (python-hyper) pumped by hand; ``hyperframe`` parses what the server wrote."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import h2.config
import h2.connection
import hyperframe.frame as hf

from quiver.frontends.http2 import Http2Connection

REQUEST = [(":method", "POST"), (":scheme", "http"), (":path", "/svc/Echo"), (":authority", "x"),
           ("content-type", "application/grpc"), ("te", "trailers")]


class Transport:
    def __init__(self, protocol: Http2Connection) -> None:
        self.protocol = protocol
        self.out = bytearray()
        self.closed = False
        self.reading = True
        self.stuck = False  # True: a client that reads nothing (close waits for it; abort does not)
        self.unsent = 0  # what get_write_buffer_size says
        self.aborted = self.lost = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "a write after close"
        self.out += data

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if not self.stuck:
                self.lost = True
                asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def abort(self) -> None:
        self.aborted = True
        if not self.lost:
            self.closed = self.lost = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def get_write_buffer_size(self) -> int:
        return self.unsent

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5555)}.get(name, default)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


class Pair:
    """The server connection and an h2 client connection, pumped by hand."""

    def __init__(
        self, owner: Any, client_settings: dict[Any, int] | None = None, server: Http2Connection | None = None
    ) -> None:
        self.owner = owner
        self.server = server or Http2Connection(self.owner)  # type: ignore[arg-type]
        self.transport = Transport(self.server)
        self.server.connection_made(self.transport)
        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        self.client = h2.connection.H2Connection(config)
        self.client.initiate_connection()
        if client_settings:
            self.client.update_settings(client_settings)
        self.events: list[Any] = []
        self.pump()

    def pump(self) -> list[Any]:
        """Client bytes to the server, the server's answer to the client; the new events."""
        outgoing = self.client.data_to_send()
        if outgoing:
            self.server.data_received(outgoing)
        return self.receive()

    def receive(self) -> list[Any]:
        events = self.client.receive_data(bytes(self.transport.out)) if self.transport.out else []
        self.transport.out.clear()
        self.events += events
        outgoing = self.client.data_to_send()  # the client's acknowledgements
        if outgoing and not self.transport.closed:
            self.server.data_received(outgoing)
        return events

    def raw(self, data: bytes) -> None:
        self.server.data_received(data)

    def goaway(self) -> tuple[int, int, bytes]:
        """The (last stream id, error code, debug data) of the GOAWAY the server sent."""
        for frame in frames_of(bytes(self.transport.out)):
            if isinstance(frame, hf.GoAwayFrame):
                return frame.last_stream_id, frame.error_code, frame.additional_data
        raise AssertionError("no GOAWAY")

    def request(self, body: bytes = b"", headers: list[tuple[str, str]] | None = None, end: bool = True) -> int:
        stream_id: int = self.client.get_next_available_stream_id()
        self.client.send_headers(stream_id, headers or REQUEST, end_stream=not body and end)
        if body:
            self.client.send_data(stream_id, body, end_stream=end)
        return stream_id


def raw_frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    """A frame as bytes, for the ones hyperframe will not build (they break the rules)."""
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream_id.to_bytes(4, "big") + payload


def frames_of(data: bytes) -> list[Any]:
    found, at = [], 0
    while len(data) - at >= 9:
        frame, length = hf.Frame.parse_frame_header(memoryview(data[at : at + 9]))
        frame.parse_body(memoryview(data[at + 9 : at + 9 + length]))
        found.append(frame)
        at += 9 + length
    return found


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


def of(events: list[Any], kind: type) -> list[Any]:
    return [event for event in events if isinstance(event, kind)]



__all__ = ["REQUEST", "Pair", "Transport", "frames_of", "of", "raw_frame", "run"]
