"""A gRPC client made of the ``h2`` package (python-hyper's HTTP/2 state machine) over a plain
socket, for what ``grpcio`` never sends or never shows: a window the test controls, a reset in
the middle of a call, a deadline the client does not enforce itself, raw ``-bin`` headers,
compressed messages and the exact response headers and trailers."""

from __future__ import annotations

import gzip
import socket
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote_to_bytes

import h2.config
import h2.connection
import h2.events

SERVICE = "/inference.GRPCInferenceService/"


@dataclass
class Reply:
    headers: dict[bytes, bytes] = field(default_factory=dict)
    trailers: dict[bytes, bytes] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    reset: int | None = None
    ended: bool = False

    @property
    def status(self) -> int:
        """The grpc-status (from the trailers, or from the headers of a trailers-only answer)."""
        return int((self.trailers or self.headers)[b"grpc-status"])

    @property
    def message(self) -> str:
        raw = (self.trailers or self.headers).get(b"grpc-message", b"")
        return unquote_to_bytes(raw).decode("utf-8")

    def messages(self) -> list[bytes]:
        """The length-prefixed messages of the body (inflated as grpc-encoding says)."""
        found, at, body = [], 0, bytes(self.body)
        while at < len(body):
            flag, length = body[at], int.from_bytes(body[at + 1 : at + 5], "big")
            data = body[at + 5 : at + 5 + length]
            at += 5 + length
            if flag:
                encoding = self.headers[b"grpc-encoding"]
                data = gzip.decompress(data) if encoding == b"gzip" else zlib.decompress(data)
            found.append(data)
        return found


def framed(message: bytes, compress: str | None = None) -> bytes:
    if compress == "gzip":
        return b"\x01" + len(data := gzip.compress(message)).to_bytes(4, "big") + data
    if compress == "deflate":
        return b"\x01" + len(data := zlib.compress(message)).to_bytes(4, "big") + data
    return b"\x00" + len(message).to_bytes(4, "big") + message


class RawGrpc:
    """One HTTP/2 connection; ``auto_ack=False`` leaves the client's windows to the test."""

    def __init__(self, port: int, *, auto_ack: bool = True, timeout: float = 30.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.conn.initiate_connection()
        self.auto_ack = auto_ack
        self.replies: dict[int, Reply] = {}
        self.events: list[Any] = []
        self.flush()

    def close(self) -> None:
        self.sock.close()

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def start(self, method: str, metadata: Sequence[tuple[str, str]] = (), *, end: bool = False) -> int:
        stream_id: int = self.conn.get_next_available_stream_id()
        headers = [
            (":method", "POST"), (":scheme", "http"), (":path", method if method.startswith("/") else SERVICE + method),
            (":authority", "localhost"), ("content-type", "application/grpc"), ("te", "trailers"),
            ("grpc-accept-encoding", "identity,deflate,gzip"), *metadata,
        ]
        self.conn.send_headers(stream_id, headers, end_stream=end)
        self.replies[stream_id] = Reply()
        self.flush()
        return stream_id

    def send(self, stream_id: int, data: bytes, *, end: bool = True) -> None:
        """``data`` as DATA frames, as the server's windows and frame size allow."""
        view = memoryview(data)
        while view:
            room = min(self.conn.local_flow_control_window(stream_id), self.conn.max_outbound_frame_size)
            if room <= 0:
                self.read()
                continue
            self.conn.send_data(stream_id, bytes(view[:room]))
            view = view[room:]
            self.flush()
        if end:
            self.conn.end_stream(stream_id)
            self.flush()

    def read(self) -> list[Any]:
        data = self.sock.recv(1 << 16)
        if not data:
            raise EOFError("the server closed the connection")
        events = self.conn.receive_data(data)
        for event in events:
            reply = self.replies.get(getattr(event, "stream_id", 0))
            if isinstance(event, h2.events.DataReceived):
                if reply is not None:
                    reply.body += event.data
                if self.auto_ack:
                    self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif reply is None:
                continue
            elif isinstance(event, h2.events.ResponseReceived):
                reply.headers = dict(event.headers)
            elif isinstance(event, h2.events.TrailersReceived):
                reply.trailers = dict(event.headers)
            elif isinstance(event, h2.events.StreamEnded):
                reply.ended = True
            elif isinstance(event, h2.events.StreamReset):
                reply.reset = event.error_code
        self.events += events
        self.flush()
        return events

    def wait(self, stream_id: int) -> Reply:
        reply = self.replies[stream_id]
        while not reply.ended and reply.reset is None:
            self.read()
        return reply

    def call(self, method: str, message: bytes, metadata: Sequence[tuple[str, str]] = (), compress: str | None = None) -> Reply:
        stream_id = self.start(method, metadata)
        self.send(stream_id, framed(message, compress))
        return self.wait(stream_id)


__all__ = ["SERVICE", "RawGrpc", "Reply", "framed"]
