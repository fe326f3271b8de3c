"""Quiver's HTTP/2 server connection (frontends/http2.py) against an independent client: the
``h2`` package's connection state machine (python-hyper) and ``hyperframe``'s frames for what a
correct client never sends. The connection runs on a real event loop with an in-memory
transport; its owner and stream handlers are small recorders."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import hyperframe.frame as hf
import pytest

from quiver.frontends import http2_frames as frames
from quiver.frontends import http2_guard
from quiver.frontends.http2 import CONNECTION_WINDOW, Http2Connection, Keepalive
from quiver.frontends.http2_stream import STREAM_WINDOW, Stream
from support.h2pair import REQUEST, Pair, Transport, frames_of, of, raw_frame, run


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
            self.connection.top_up(self.stream)
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
        self.unfinished_header_bytes = 0
        self.pending_send = 0
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

    def connection_made(self, connection: Http2Connection) -> None:
        pass

    def connection_idle(self, connection: Http2Connection) -> None:
        pass

    def connection_busy(self, connection: Http2Connection) -> None:
        pass

    def connection_closed(self, connection: Http2Connection) -> None:
        self.closed = True


def test_settings_are_exchanged_and_a_request_is_answered() -> None:
    async def main() -> None:
        pair = Pair(Owner())
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
        pair = Pair(Owner())
        pair.client.ping(b"12345678")
        assert of(pair.pump(), h2.events.PingAckReceived)[0].ping_data == b"12345678"

    run(main)


def test_a_header_block_in_continuation_frames_and_padded_data() -> None:
    async def main() -> None:
        pair = Pair(Owner())
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
        pair = Pair(Owner())
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
        pair = Pair(Owner())
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
    """A stream's window comes back as its handler asks: a client past the window of a stream
    whose reader took nothing has the stream reset (FLOW_CONTROL_ERROR), and no WINDOW_UPDATE
    was sent for it meanwhile."""

    async def main() -> None:
        pair = Pair(Owner())
        pair.owner.consume = False
        stream_id = pair.request(b"", end=False)
        pair.pump()
        pair.transport.out.clear()
        raw = b"".join(hf.DataFrame(stream_id, b"z" * 16384).serialize() for _ in range(3))
        raw += hf.DataFrame(stream_id, b"z" * (STREAM_WINDOW - 3 * 16384)).serialize()
        pair.raw(raw)
        assert pair.owner.handlers[stream_id].reset is None
        assert not [f for f in frames_of(bytes(pair.transport.out)) if isinstance(f, hf.WindowUpdateFrame) and f.stream_id]
        pair.raw(hf.DataFrame(stream_id, b"!").serialize())
        resets = [f for f in frames_of(bytes(pair.transport.out)) if isinstance(f, hf.RstStreamFrame)]
        assert resets[0].error_code == h2.errors.ErrorCodes.FLOW_CONTROL_ERROR
        assert pair.owner.handlers[stream_id].reset == h2.errors.ErrorCodes.FLOW_CONTROL_ERROR
        assert not pair.transport.closed

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
        resets = [f for f in frames_of(bytes(pair.transport.out)) if isinstance(f, hf.RstStreamFrame)]
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
        pair = Pair(Owner())
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
        pair = Pair(Owner())
        pair.client.update_settings({h2.settings.SettingCodes.HEADER_TABLE_SIZE: 0})
        pair.pump()
        pair.request(b"x")
        pair.server.data_received(pair.client.data_to_send())
        blocks = [f.data for f in frames_of(bytes(pair.transport.out)) if isinstance(f, hf.HeadersFrame)]
        assert blocks[0][:1] == b"\x20" and blocks[1][:1] != b"\x20"
        events = pair.receive()
        assert of(events, h2.events.ResponseReceived)[0].headers == [(b":status", b"200")]

    run(main)


def test_trailers_from_the_client_end_its_stream() -> None:
    async def main() -> None:
        pair = Pair(Owner())
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
        goaway, ping = frames_of(bytes(pair.transport.out))
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
        assert [(f.stream_id, f.error_code) for f in frames_of(bytes(pair.transport.out)) if isinstance(f, hf.RstStreamFrame)] == [
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
        pair = Pair(Owner())
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
        pair = Pair(Owner())
        stream_id = pair.client.get_next_available_stream_id()
        encoder = pair.client.encoder
        block = encoder.encode([(":method", "POST"), (":path", "/svc/Echo")])  # no :scheme
        pair.raw(hf.HeadersFrame(stream_id, block, flags=["END_HEADERS", "END_STREAM"]).serialize())
        resets = [f for f in frames_of(bytes(pair.transport.out)) if isinstance(f, hf.RstStreamFrame)]
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


# -- what a hostile client cannot make the connection hold or spend (review of the server) ----


def test_empty_or_many_continuation_frames_end_the_connection() -> None:
    """CVE-2024-27316's flood: empty CONTINUATION frames, or many small ones, never make a
    header block; the connection ends with ENHANCE_YOUR_CALM."""

    async def main() -> None:
        for payload, count in ((b"", 1), (b"\x00", 200)):
            pair = Pair(Owner())
            pair.transport.out.clear()
            pair.raw(hf.HeadersFrame(1, b"\x82", flags=[]).serialize())
            for _ in range(count):
                if pair.transport.closed:
                    break
                pair.raw(raw_frame(0x9, 0, 1, payload))
            assert pair.goaway()[1] == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
            assert pair.transport.closed

    run(main)


def test_unfinished_header_blocks_are_bounded_on_all_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """HEADERS without END_HEADERS spread over many connections, each under its own limit
    (2,000 connections held 232 MB for as long as they kept starting blocks): past the bound
    on all of them, the connection that adds more ends with ENHANCE_YOUR_CALM; a block that
    finishes gives its bytes back."""
    monkeypatch.setattr(http2_guard, "MAX_UNFINISHED_HEADER_BYTES", 20_000, raising=False)

    async def main() -> None:
        owner = Owner()
        pairs = [Pair(owner) for _ in range(3)]
        blocks = [pair.client.encoder.encode([*REQUEST, ("x-pad", "v" * 9000)], huffman=False) for pair in pairs]
        for pair, block in zip(pairs, blocks, strict=True):
            pair.transport.out.clear()
            pair.raw(hf.HeadersFrame(1, block[:8000], flags=[]).serialize())
        assert [pair.transport.closed for pair in pairs] == [False, False, True]
        assert pairs[2].goaway()[1] == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
        await asyncio.sleep(0)
        assert owner.unfinished_header_bytes == 16_000
        pairs[0].raw(hf.ContinuationFrame(1, blocks[0][8000:], flags=["END_HEADERS"]).serialize())
        assert not pairs[0].transport.closed and 1 in owner.handlers
        assert owner.unfinished_header_bytes == 8000
        pairs[1].transport.close()
        await asyncio.sleep(0)
        assert owner.unfinished_header_bytes == 0

    run(main)


def test_a_client_that_does_not_read_is_not_answered_into_memory() -> None:
    """CVE-2019-9515: SETTINGS the client never reads the acknowledgements of. Reading stops
    while the transport cannot write, and past the induced-frame limit the connection ends."""

    async def main() -> None:
        pair = Pair(Owner())
        paused: list[str] = []
        pair.transport.pause_reading = lambda: paused.append("pause")  # type: ignore[attr-defined]
        pair.transport.resume_reading = lambda: paused.append("resume")  # type: ignore[attr-defined]
        pair.server.pause_writing()
        assert paused == ["pause"]
        pair.server.resume_writing()
        assert paused == ["pause", "resume"]
        pair.transport.out.clear()
        flood = hf.SettingsFrame(0).serialize() * 10_001
        pair.raw(flood)
        assert pair.goaway()[1] == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM

    run(main)


def test_a_header_list_past_the_announced_size_ends_the_connection() -> None:
    async def main() -> None:
        pair = Pair(Owner())
        encoder = pair.client.encoder
        block = encoder.encode([*REQUEST, ("x-big", "v" * 70_000)])  # past 64 KiB
        pair.transport.out.clear()
        frames_ = [hf.HeadersFrame(1, block[:16384], flags=[]).serialize()]
        rest = block[16384:]
        while rest:
            chunk, rest = rest[:16384], rest[16384:]
            frames_.append(hf.ContinuationFrame(1, chunk, flags=[] if rest else ["END_HEADERS"]).serialize())
        pair.raw(b"".join(frames_))
        assert pair.goaway()[1] in (h2.errors.ErrorCodes.COMPRESSION_ERROR, h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
        assert pair.owner.heads == []

    run(main)


def test_rapid_resets_end_the_connection_and_count_until_their_work_ends() -> None:
    """CVE-2023-44487: streams opened and reset at once. A reset stream whose handler still
    works counts against the stream limit; past the reset budget the connection ends."""

    async def main() -> None:
        owner = Owner(max_concurrent_streams=4)
        owner.answer = lambda handler: None
        pair = Pair(owner)
        busy = {"yes": True}
        Handler.stream_reset = lambda self, code: (setattr(self, "reset", code), busy["yes"])[1]  # type: ignore[method-assign]
        try:
            for _ in range(4):  # four streams reset whose work goes on: the limit is reached
                stream_id = pair.request(b"x")
                pair.client.reset_stream(stream_id)
            pair.pump()
            assert pair.server.streams == {} and pair.server._zombies == 4
            pair.transport.out.clear()
            pair.raw(hf.HeadersFrame(9, pair.client.encoder.encode(REQUEST), flags=["END_HEADERS", "END_STREAM"]).serialize())
            resets = [(f.stream_id, f.error_code) for f in frames_of(bytes(pair.transport.out)) if isinstance(f, hf.RstStreamFrame)]
            assert resets == [(9, h2.errors.ErrorCodes.REFUSED_STREAM)]
            for _ in range(4):
                pair.server.stream_done()
            busy["yes"] = False
            pair.transport.out.clear()
            encoder, stream_id = pair.client.encoder, 11
            flood = b""
            for _ in range(400):
                flood += hf.HeadersFrame(stream_id, encoder.encode(REQUEST), flags=["END_HEADERS"]).serialize()
                flood += hf.RstStreamFrame(stream_id, 8).serialize()
                stream_id += 2
            for at in range(0, len(flood), 4096):
                if pair.transport.closed:
                    break
                pair.raw(flood[at : at + 4096])
                await asyncio.sleep(0)  # the reads yield after 64 new streams
            assert pair.goaway()[1] == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
        finally:
            del Handler.stream_reset

    run(main)


def test_a_block_that_changes_the_table_is_never_served_from_the_cache() -> None:
    """A cached reading must not outlive the HPACK table it was decoded with: a malformed
    request that inserts an entry, then the bytes of a cached block again, which now decode
    differently (here: two :path fields), is reset, not answered from the cache."""

    async def main() -> None:
        pair = Pair(Owner())
        import hpack

        encoder = hpack.Encoder()
        first = encoder.encode(REQUEST)  # fills the table
        pair.raw(hf.HeadersFrame(1, first, flags=["END_HEADERS", "END_STREAM"]).serialize())
        again = encoder.encode(REQUEST)  # all indexes
        pair.raw(hf.HeadersFrame(3, again, flags=["END_HEADERS", "END_STREAM"]).serialize())
        pair.raw(hf.HeadersFrame(5, again, flags=["END_HEADERS", "END_STREAM"]).serialize())
        assert len(pair.owner.heads) == 2  # the third was read from the cache
        # a malformed request (no :method) that inserts a :path entry into the table
        bad = encoder.encode([(":scheme", "http"), (":path", "/other")])
        pair.raw(hf.HeadersFrame(7, bad, flags=["END_HEADERS", "END_STREAM"]).serialize())
        pair.transport.out.clear()
        pair.raw(hf.HeadersFrame(9, again, flags=["END_HEADERS", "END_STREAM"]).serialize())
        resets = [(f.stream_id, f.error_code) for f in frames_of(bytes(pair.transport.out)) if isinstance(f, hf.RstStreamFrame)]
        assert resets == [(9, h2.errors.ErrorCodes.PROTOCOL_ERROR)]

    run(main)


@pytest.mark.parametrize("value", ["a\r\nx-injected: 1", "a\x00b", " padded", "trailing\t"])
def test_field_values_with_nul_cr_lf_or_edge_white_space_are_malformed(value: str) -> None:
    async def main() -> None:
        pair = Pair(Owner())
        import hpack

        block = hpack.Encoder().encode([*REQUEST, ("x-meta", value)])
        pair.transport.out.clear()
        pair.raw(hf.HeadersFrame(1, block, flags=["END_HEADERS", "END_STREAM"]).serialize())
        resets = [(f.stream_id, f.error_code) for f in frames_of(bytes(pair.transport.out)) if isinstance(f, hf.RstStreamFrame)]
        assert resets == [(1, h2.errors.ErrorCodes.PROTOCOL_ERROR)]
        assert pair.owner.handlers == {} and not pair.transport.closed

    run(main)


def test_no_reset_of_an_idle_stream_for_a_bad_priority() -> None:
    async def main() -> None:
        pair = Pair(Owner())
        pair.transport.out.clear()
        pair.raw(raw_frame(0x2, 0, 101, bytes(5)))  # a fine PRIORITY for a stream not yet open
        assert not pair.transport.out and not pair.transport.closed
        pair.raw(raw_frame(0x2, 0, 101, bytes(4)))  # a bad one: a connection error, not RST_STREAM
        assert not [f for f in frames_of(bytes(pair.transport.out)) if isinstance(f, hf.RstStreamFrame)]
        assert pair.goaway()[1] == h2.errors.ErrorCodes.FRAME_SIZE_ERROR

    run(main)
