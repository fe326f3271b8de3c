"""Quiver's HTTP/2 server connection (frontends/http2.py) against an independent client: the
``h2`` package's connection state machine (python-hyper) and ``hyperframe``'s frames for what a
correct client never sends. The connection runs on a real event loop with an in-memory
transport; its owner and stream handlers are small recorders."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import hyperframe.frame as hf
import pytest

from quiver.frontends import http2_frames as frames
from quiver.frontends.http2 import CONNECTION_WINDOW, Http2Connection, Keepalive
from quiver.frontends.http2_stream import STREAM_WINDOW, Stream

REQUEST = [(":method", "POST"), (":scheme", "http"), (":path", "/svc/Echo"), (":authority", "x"),
           ("content-type", "application/grpc"), ("te", "trailers")]


class Transport:
    def __init__(self, protocol: Http2Connection) -> None:
        self.protocol = protocol
        self.out = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "a write after close"
        self.out += data

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5555)}.get(name, default)


class Handler:
    """Records a stream; answers at its end as the owner's ``answer`` says."""

    def __init__(self, owner: Owner, connection: Http2Connection, stream: Stream, head: Any) -> None:
        self.owner, self.connection, self.stream, self.head = owner, connection, stream, head
        self.data = bytearray()
        self.ended = False
        self.reset: int | None = None

    def data_received(self, data: memoryview, end_stream: bool) -> None:
        self.data += data
        if self.owner.consume:
            self.connection.consume(self.stream, len(data))
        if end_stream:
            self.ended = True
            self.owner.answer(self)

    def stream_reset(self, code: int) -> bool:
        self.reset = code
        return False


def answer_small(handler: Handler) -> None:
    handler.connection.respond(
        handler.stream, frames.header_block([(b":status", b"200")]), bytes(handler.data),
        frames.header_block([(b"grpc-status", b"0")]),
    )


class Owner:
    def __init__(self, *, max_concurrent_streams: int = 8, keepalive: Keepalive | None = None) -> None:
        self.max_concurrent_streams = max_concurrent_streams
        self.max_header_list_size = 65536
        self.keepalive = keepalive or Keepalive(time=None)
        self.heads: list[list[tuple[bytes, bytes]]] = []
        self.handlers: dict[int, Handler] = {}
        self.closed = False
        self.consume = True
        self.accept = True
        self.answer: Callable[[Handler], None] = answer_small

    def accepting(self, connection: Http2Connection) -> bool:
        return self.accept

    def parse_head(self, headers: list[tuple[bytes, bytes]], stream_id: int) -> Any:
        frames.request_head(stream_id, headers)
        self.heads.append(headers)
        return dict(headers)

    def open_stream(self, connection: Http2Connection, stream: Stream, head: Any, end_stream: bool) -> Handler:
        handler = Handler(self, connection, stream, head)
        self.handlers[stream.id] = handler
        if end_stream:
            handler.data_received(memoryview(b""), True)
        return handler

    def connection_closed(self, connection: Http2Connection) -> None:
        self.closed = True


class Pair:
    """The server connection and an h2 client connection, pumped by hand."""

    def __init__(self, owner: Owner | None = None, **client_settings: int) -> None:
        self.owner = owner or Owner()
        self.server = Http2Connection(self.owner)  # type: ignore[arg-type]
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
        for frame in _frames(bytes(self.transport.out)):
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


def _frames(data: bytes) -> list[Any]:
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


def test_settings_are_exchanged_and_a_request_is_answered() -> None:
    async def main() -> None:
        pair = Pair()
        changed = of(pair.events, h2.events.RemoteSettingsChanged)[0].changed_settings
        assert changed[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS].new_value == 8
        assert changed[h2.settings.SettingCodes.INITIAL_WINDOW_SIZE].new_value == STREAM_WINDOW
        assert of(pair.events, h2.events.SettingsAcknowledged)  # the client's settings
        assert of(pair.events, h2.events.WindowUpdated)[0].delta == CONNECTION_WINDOW - 65535
        stream_id = pair.request(b"hello")
        events = pair.pump()
        assert of(events, h2.events.ResponseReceived)[0].headers == [(b":status", b"200")]
        assert of(events, h2.events.DataReceived)[0].data == b"hello"
        assert of(events, h2.events.TrailersReceived)[0].headers == [(b"grpc-status", b"0")]
        assert of(events, h2.events.StreamEnded)[0].stream_id == stream_id
        assert pair.server.streams == {}

    run(main)


def test_pings_are_answered_with_their_payload() -> None:
    async def main() -> None:
        pair = Pair()
        pair.client.ping(b"12345678")
        assert of(pair.pump(), h2.events.PingAckReceived)[0].ping_data == b"12345678"

    run(main)


def test_a_header_block_in_continuation_frames_and_padded_data() -> None:
    async def main() -> None:
        pair = Pair()
        big = [*REQUEST, ("x-big", "v" * 40_000)]  # past 16 KiB: HEADERS + CONTINUATION
        stream_id = pair.client.get_next_available_stream_id()
        pair.client.send_headers(stream_id, big)
        pair.client.send_data(stream_id, b"abc", pad_length=20)
        pair.client.send_data(stream_id, b"def", end_stream=True, pad_length=3)
        pair.client.prioritize(stream_id, weight=32)  # PRIORITY: read and ignored
        events = pair.pump()
        assert (b"x-big", b"v" * 40_000) in pair.owner.heads[-1]
        assert of(events, h2.events.DataReceived)[0].data == b"abcdef"
        assert of(events, h2.events.StreamEnded)

    run(main)


def test_what_is_sent_waits_for_the_clients_windows() -> None:
    """A 200 KB answer to a client whose windows are 64 KiB: no more than the window goes out
    until the client gives credit; trailers follow the last byte."""

    async def main() -> None:
        pair = Pair()
        body = bytes(range(256)) * 800  # 204,800 bytes
        pair.owner.answer = lambda h: h.connection.respond(
            h.stream, frames.header_block([(b":status", b"200")]), body, frames.header_block([(b"grpc-status", b"0")])
        )
        stream_id = pair.request(b"x")
        received = bytearray()
        events = pair.pump()
        for event in of(events, h2.events.DataReceived):
            received += event.data
        assert 0 < len(received) <= 65535
        assert all(len(e.data) <= 16384 for e in of(events, h2.events.DataReceived))
        assert not of(events, h2.events.TrailersReceived)
        while not of(pair.events, h2.events.StreamEnded):
            data = of(events, h2.events.DataReceived)
            assert data, "the server stopped sending with window to spare"
            for event in data:
                pair.client.acknowledge_received_data(event.flow_controlled_length, stream_id)
            events = pair.pump()
            received += b"".join(e.data for e in of(events, h2.events.DataReceived))
        assert bytes(received) == body
        assert of(pair.events, h2.events.TrailersReceived)

    run(main)


def test_a_window_the_client_shrinks_to_zero_holds_the_data() -> None:
    async def main() -> None:
        pair = Pair()
        pair.client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
        pair.pump()
        stream_id = pair.request(b"abc")
        events = pair.pump()
        assert of(events, h2.events.ResponseReceived) and not of(events, h2.events.DataReceived)
        pair.client.increment_flow_control_window(10, stream_id)
        events = pair.pump()
        assert of(events, h2.events.DataReceived)[0].data == b"abc"
        assert of(events, h2.events.StreamEnded)

    run(main)


def test_a_stream_nobody_reads_stops_its_sender() -> None:
    """Credit goes back as a stream's handler takes what it received: a client past the
    windows of a stream whose reader took nothing is a flow-control error, and no
    WINDOW_UPDATE was sent meanwhile."""

    async def main() -> None:
        pair = Pair()
        pair.owner.consume = False
        stream_id = pair.request(b"", end=False)
        pair.pump()
        pair.transport.out.clear()
        chunk = b"z" * 16384
        raw = b"".join(hf.DataFrame(stream_id, chunk).serialize() for _ in range(STREAM_WINDOW // 16384))
        pair.raw(raw)
        assert pair.owner.handlers[stream_id].reset is None
        assert not [f for f in _frames(bytes(pair.transport.out)) if isinstance(f, hf.WindowUpdateFrame)]
        pair.raw(hf.DataFrame(stream_id, b"!").serialize())
        assert pair.goaway()[1] == h2.errors.ErrorCodes.FLOW_CONTROL_ERROR

    run(main)


def test_streams_past_the_limit_are_refused() -> None:
    async def main() -> None:
        owner = Owner(max_concurrent_streams=2)
        owner.answer = lambda handler: None  # streams stay open
        pair = Pair(owner)
        for _ in range(2):
            pair.request(b"x")
        pair.pump()
        # the h2 client keeps to the limit the server announced: the third stream goes raw
        pair.raw(hf.HeadersFrame(5, pair.client.encoder.encode(REQUEST), flags=["END_HEADERS", "END_STREAM"]).serialize())
        resets = [f for f in _frames(bytes(pair.transport.out)) if isinstance(f, hf.RstStreamFrame)]
        assert [(f.stream_id, f.error_code) for f in resets] == [(5, h2.errors.ErrorCodes.REFUSED_STREAM)]
        assert sorted(owner.handlers) == [1, 3]

    run(main)


def test_a_client_reset_reaches_the_handler() -> None:
    async def main() -> None:
        owner = Owner()
        owner.answer = lambda handler: None
        pair = Pair(owner)
        stream_id = pair.request(b"x")
        pair.pump()
        pair.client.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        pair.pump()
        assert owner.handlers[stream_id].reset == h2.errors.ErrorCodes.CANCEL
        assert pair.server.streams == {}
        again = pair.request(b"y")  # the connection goes on
        owner.answer = answer_small
        assert of(pair.pump(), h2.events.StreamEnded)[0].stream_id == again

    run(main)


def test_repeated_header_blocks_are_read_once() -> None:
    async def main() -> None:
        pair = Pair()
        for _ in range(5):
            pair.request(b"x")
            pair.pump()
        # the first block fills the client's table (literals with indexing), the second is all
        # indexes, the same bytes as every later one
        assert len(pair.owner.heads) == 2
        pair.request(b"x", [*REQUEST, ("x-new", "1")])  # changes the table: read, cache dropped
        pair.pump()
        pair.request(b"x")
        pair.pump()
        assert len(pair.owner.heads) == 4
        assert len(of(pair.events, h2.events.StreamEnded)) == 7

    run(main)


def test_a_smaller_header_table_is_honoured() -> None:
    """The client shrinks the server's HPACK table: the next block the server sends starts
    with a table size update (to 0: its encoder never uses the table)."""

    async def main() -> None:
        pair = Pair()
        pair.client.update_settings({h2.settings.SettingCodes.HEADER_TABLE_SIZE: 0})
        pair.pump()
        pair.request(b"x")
        pair.server.data_received(pair.client.data_to_send())
        blocks = [f.data for f in _frames(bytes(pair.transport.out)) if isinstance(f, hf.HeadersFrame)]
        assert blocks[0][:1] == b"\x20" and blocks[1][:1] != b"\x20"
        events = pair.receive()
        assert of(events, h2.events.ResponseReceived)[0].headers == [(b":status", b"200")]

    run(main)


def test_trailers_from_the_client_end_its_stream() -> None:
    async def main() -> None:
        pair = Pair()
        stream_id = pair.request(b"abc", end=False)
        pair.client.send_headers(stream_id, [("x-trailer", "1")], end_stream=True)
        assert of(pair.pump(), h2.events.StreamEnded)
        assert pair.owner.handlers[stream_id].ended

    run(main)


def test_graceful_stop_finishes_the_streams_in_progress_and_refuses_new_ones() -> None:
    async def main() -> None:
        owner = Owner()
        owner.answer = lambda handler: None
        pair = Pair(owner)
        first = pair.request(b"x")
        pair.pump()
        pair.server.shutdown()
        await asyncio.sleep(0)  # what is sent outside a read goes out once per turn of the loop
        # GOAWAY(2^31-1) and a PING (h2 takes any GOAWAY as the end: the rest goes raw)
        goaway, ping = _frames(bytes(pair.transport.out))
        assert isinstance(goaway, hf.GoAwayFrame) and (goaway.last_stream_id, goaway.error_code) == (2**31 - 1, 0)
        assert isinstance(ping, hf.PingFrame) and "ACK" not in ping.flags
        pair.transport.out.clear()
        pair.raw(hf.PingFrame(0, ping.opaque_data, flags=["ACK"]).serialize())
        last, code, _ = pair.goaway()  # the final one, once the PING was answered
        assert (last, code) == (first, 0)
        assert not pair.transport.closed  # a stream is still in progress
        # the client saw GOAWAY, so its h2 refuses new streams: a raw HEADERS goes past that
        encoder = pair.client.encoder
        pair.raw(hf.HeadersFrame(first + 2, encoder.encode(REQUEST), flags=["END_HEADERS", "END_STREAM"]).serialize())
        assert [(f.stream_id, f.error_code) for f in _frames(bytes(pair.transport.out)) if isinstance(f, hf.RstStreamFrame)] == [
            (first + 2, h2.errors.ErrorCodes.REFUSED_STREAM)
        ]
        answer_small(owner.handlers[first])
        await asyncio.sleep(0)
        assert pair.transport.closed and owner.closed

    run(main)


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", h2.errors.ErrorCodes.PROTOCOL_ERROR),
        (raw_frame(0x0, 0, 0, b"x"), h2.errors.ErrorCodes.PROTOCOL_ERROR),
        (b"\x00\x00\x03\x08\x00\x00\x00\x00\x00abc", h2.errors.ErrorCodes.FRAME_SIZE_ERROR),  # WINDOW_UPDATE of 3 bytes
        (hf.SettingsFrame(0, settings={5: 100}).serialize(), h2.errors.ErrorCodes.PROTOCOL_ERROR),  # MAX_FRAME_SIZE
        (hf.SettingsFrame(0, settings={4: 2**31}).serialize(), h2.errors.ErrorCodes.FLOW_CONTROL_ERROR),
        (hf.WindowUpdateFrame(0, 2**31 - 1).serialize(), h2.errors.ErrorCodes.FLOW_CONTROL_ERROR),
        (raw_frame(0x8, 0, 0, bytes(4)), h2.errors.ErrorCodes.PROTOCOL_ERROR),
        (raw_frame(0x9, 0x4, 1, b""), h2.errors.ErrorCodes.PROTOCOL_ERROR),
        (raw_frame(0x1, 0x4, 2, b"\x82"), h2.errors.ErrorCodes.PROTOCOL_ERROR),
        (raw_frame(0x5, 0x4, 1, bytes(4)), h2.errors.ErrorCodes.PROTOCOL_ERROR),
        (raw_frame(0x6, 0, 1, b"12345678"), h2.errors.ErrorCodes.PROTOCOL_ERROR),
        (raw_frame(0x3, 0, 9, bytes(4)), h2.errors.ErrorCodes.PROTOCOL_ERROR),  # an idle stream
        (b"\x00\x40\x01\x00\x00\x00\x00\x00\x01" + b"\x00" * 0x4001, h2.errors.ErrorCodes.FRAME_SIZE_ERROR),
        (hf.HeadersFrame(1, b"\xff\xff\xff\xff", flags=["END_HEADERS"]).serialize(), h2.errors.ErrorCodes.COMPRESSION_ERROR),
    ],
    ids=["preface", "data-on-0", "window-update-size", "max-frame-size", "initial-window", "window-overflow",
         "window-update-0", "continuation", "even-stream", "push-promise", "ping-on-stream", "rst-idle",
         "frame-too-large", "hpack"],
)
def test_protocol_errors_get_goaway_and_close(raw: bytes, code: int) -> None:
    async def main() -> None:
        pair = Pair()
        if raw.startswith(b"GET"):
            pair = Pair.__new__(Pair)
            pair.owner = Owner()
            pair.server = Http2Connection(pair.owner)  # type: ignore[arg-type]
            pair.transport = Transport(pair.server)
            pair.server.connection_made(pair.transport)
        else:
            pair.transport.out.clear()
        pair.raw(raw)
        assert pair.goaway()[1] == code
        assert pair.transport.closed
        await asyncio.sleep(0)
        assert pair.owner.closed

    run(main)


def test_a_malformed_request_resets_its_stream_only() -> None:
    async def main() -> None:
        pair = Pair()
        stream_id = pair.client.get_next_available_stream_id()
        encoder = pair.client.encoder
        block = encoder.encode([(":method", "POST"), (":path", "/svc/Echo")])  # no :scheme
        pair.raw(hf.HeadersFrame(stream_id, block, flags=["END_HEADERS", "END_STREAM"]).serialize())
        resets = [f for f in _frames(bytes(pair.transport.out)) if isinstance(f, hf.RstStreamFrame)]
        assert [(f.stream_id, f.error_code) for f in resets] == [(stream_id, h2.errors.ErrorCodes.PROTOCOL_ERROR)]
        assert not pair.transport.closed

    run(main)


def test_a_client_pinging_too_often_gets_too_many_pings() -> None:
    async def main() -> None:
        pair = Pair(Owner(keepalive=Keepalive(time=None, max_ping_strikes=2)))
        for number in range(3):  # the first is allowed, then two strikes
            pair.client.ping(b"%08d" % number)
            assert of(pair.pump(), h2.events.PingAckReceived)
        pair.transport.out.clear()
        pair.raw(hf.PingFrame(0, b"88888888").serialize())
        _, code, debug = pair.goaway()
        assert (code, debug) == (h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, b"too_many_pings")

    run(main)


def test_keepalive_pings_and_a_client_that_does_not_answer() -> None:
    async def main() -> None:
        keepalive = Keepalive(time=0.05, timeout=0.1, permit_without_calls=True, max_pings_without_data=0)
        pair = Pair(Owner(keepalive=keepalive))
        for _ in range(100):  # a keepalive PING comes, and the client answers it
            await asyncio.sleep(0.02)
            if of(pair.receive(), h2.events.PingReceived):
                break
        assert of(pair.events, h2.events.PingReceived)
        assert not pair.transport.closed
        for _ in range(100):  # now nobody reads the server's pings: it closes the connection
            await asyncio.sleep(0.02)
            if pair.transport.closed:
                break
        assert pair.transport.closed

    run(main)
