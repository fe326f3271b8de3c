"""What a client can make Quiver's gRPC server hold: request bytes under the receive budget,
streaming requests as raw bytes, answers that wait for a window. The real ``GrpcServer`` (no
listener) owns an in-process HTTP/2 connection driven by the ``h2`` client (tests/support/h2pair.py)."""

from __future__ import annotations

import asyncio
import gc
import resource
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import hyperframe.frame as hf
import pytest

from quiver.frontends import grpc_server, http2, http2_guard
from quiver.frontends.grpc_server import GrpcServer, RpcMethod
from support.h2pair import REQUEST, Pair, Transport, frames_of, of, run

MB = 1 << 20


def _server(max_message: int = 4 * MB) -> tuple[GrpcServer, dict[str, Any]]:
    seen: dict[str, Any] = {"stream_reads": 0, "release": None}

    async def echo(data: bytes, context: Any) -> bytes:
        return data

    async def big(data: bytes, context: Any) -> bytes:
        return b"a" * 100_000

    async def never_reads(requests: Any, context: Any) -> Any:
        seen["release"] = asyncio.get_running_loop().create_future()
        await seen["release"]
        async for _ in requests:
            seen["stream_reads"] += 1
        yield b"done"

    methods = {
        "/svc/Echo": RpcMethod("/svc/Echo", echo),
        "/svc/Big": RpcMethod("/svc/Big", big),
        "/svc/Stream": RpcMethod("/svc/Stream", never_reads, request_streaming=True, response_streaming=True),
    }
    server = GrpcServer(methods, max_receive_message_size=max_message, max_send_message_size=max_message)
    return server, seen


def _headers(path: str) -> list[tuple[str, str]]:
    return [(name, path if name == ":path" else value) for name, value in REQUEST]


def _fill(pair: Pair, stream_id: int, data: bytes) -> int:
    """Send as much of ``data`` as the server's windows allow; how much went."""
    sent = 0
    while sent < len(data):
        room = min(pair.client.local_flow_control_window(stream_id), pair.client.max_outbound_frame_size, len(data) - sent)
        if room <= 0:
            break
        pair.client.send_data(stream_id, data[sent : sent + room])
        sent += room
        pair.pump()
    return sent


def test_request_bytes_held_are_bounded_by_the_budget() -> None:
    """Streams that announce large messages and send them slowly: a message gets credit only
    once the budget has room for all of it, so what a connection holds stays within its share
    (and the windows it was granted), and admitted messages finish before others start; what
    a stream held goes back when it ends."""

    async def main() -> None:
        server, _ = _server(max_message=4 * MB)
        pair = Pair(server)
        body = b"\x00" + (4 * MB - 1).to_bytes(4, "big") + bytes(4 * MB - 100)
        streams, held = [], 0
        for _ in range(4):
            stream_id = pair.client.get_next_available_stream_id()
            pair.client.send_headers(stream_id, _headers("/svc/Echo"))
            if of(pair.pump(), h2.events.StreamReset):
                continue  # refused: the connection's share was spent
            streams.append(stream_id)
            held += _fill(pair, stream_id, body)
        assert len(streams) >= 2
        assert held <= server.budget.per_connection + 2 * MB
        assert server.budget.used <= server.budget.per_connection and pair.server.buffered == server.budget.used
        first = streams[0]
        calls = {sid: pair.server.streams[sid].handler for sid in streams}
        assert calls[first]._request._admitted == 4 * MB + 4  # type: ignore[union-attr]
        assert not any(calls[sid]._request and calls[sid]._request._admitted for sid in streams[1:])  # type: ignore[union-attr]
        # the first message finishes: the second is admitted once its prefix is here, and gets credit
        pair.client.send_data(first, bytes(99), end_stream=True)
        pair.pump()
        for _ in range(10):
            await asyncio.sleep(0)
        second = streams[1]
        held = _fill(pair, second, body[:5] if calls[second]._request is None else b"")  # type: ignore[union-attr]
        pair.pump()
        assert calls[second]._request._admitted == 4 * MB + 4  # type: ignore[union-attr]
        assert _fill(pair, second, body[5 : 5 + 2 * MB]) > 1 * MB  # credit keeps coming
        for sid in streams[1:]:
            pair.client.reset_stream(sid)
        pair.pump()
        for _ in range(10):
            await asyncio.sleep(0)
        assert server.budget.used == pair.server.buffered  # only what the first call's answer holds

    run(main)


def test_new_streams_are_refused_while_the_budget_is_spent() -> None:
    async def main() -> None:
        server, _ = _server(max_message=4 * MB)
        pair = Pair(server)
        pair.server.buffered = server.budget.per_connection  # this connection's share is spent
        server.budget.used = server.budget.per_connection
        stream_id = pair.client.get_next_available_stream_id()
        pair.client.send_headers(stream_id, _headers("/svc/Echo"), end_stream=True)
        refused = of(pair.pump(), h2.events.StreamReset)
        assert [(e.stream_id, e.error_code) for e in refused] == [(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)]

    run(main)


def test_a_message_past_the_limit_is_refused_from_its_prefix() -> None:
    async def main() -> None:
        server, _ = _server(max_message=1 * MB)
        pair = Pair(server)
        stream_id = pair.client.get_next_available_stream_id()
        pair.client.send_headers(stream_id, _headers("/svc/Echo"))
        pair.client.send_data(stream_id, b"\x00" + (2 * MB).to_bytes(4, "big") + b"xx")
        events = pair.pump()
        (headers,) = of(events, h2.events.ResponseReceived)
        assert dict(headers.headers)[b"grpc-status"] == b"8"
        assert server.budget.used == 0

    run(main)


def test_a_streaming_request_nobody_reads_holds_its_raw_bytes_only() -> None:
    """Tiny messages queue as the bytes they came in (no object per message), within the
    stream's window: the server gives no credit back until the reader takes them."""

    async def main() -> None:
        server, seen = _server()
        pair = Pair(server)
        stream_id = pair.client.get_next_available_stream_id()
        pair.client.send_headers(stream_id, _headers("/svc/Stream"))
        pair.pump()
        await asyncio.sleep(0)
        sent = _fill(pair, stream_id, b"\x00\x00\x00\x00\x00" * 400_000)
        assert sent < 400_000 * 5  # the window ran out: no credit while nobody reads
        assert server.budget.used == sent and sent <= 2 * MB
        call = pair.server.streams[stream_id].handler
        assert call is not None and call._request.pending() == sent  # type: ignore[attr-defined]
        seen["release"].set_result(None)  # the reader takes them: credit comes back
        for _ in range(50):
            await asyncio.sleep(0)
        assert seen["stream_reads"] == sent // 5
        assert server.budget.used == sent % 5  # a message cut short by the window
        assert [e for e in of(pair.receive(), h2.events.WindowUpdated) if e.stream_id == stream_id]

    run(main)


def test_an_answer_that_waits_too_long_for_window_is_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that never opens its window: the answer waits, then the stream is reset and
    what it held is freed; its request was dropped as soon as the handler had it."""
    monkeypatch.setattr(http2_guard, "STALL_SECONDS", 0.1)
    monkeypatch.setattr(http2_guard, "HOUSEKEEPING_SECONDS", 0.05)

    async def main() -> None:
        server, _ = _server()
        pair = Pair(server, {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
        stream_id = pair.client.get_next_available_stream_id()
        pair.client.send_headers(stream_id, _headers("/svc/Big"))
        pair.client.send_data(stream_id, b"\x00\x00\x00\x00\x03abc", end_stream=True)
        pair.pump()
        call = pair.server.streams[stream_id].handler
        for _ in range(20):
            await asyncio.sleep(0)
        assert pair.server.pending_send == 100_005
        assert call is not None and call._message is None  # type: ignore[attr-defined]
        await asyncio.sleep(0.3)
        resets = [(f.stream_id, f.error_code) for f in frames_of(bytes(pair.transport.out)) if isinstance(f, hf.RstStreamFrame)]
        assert resets == [(stream_id, h2.errors.ErrorCodes.CANCEL)]
        assert pair.server.pending_send == 0 and pair.server.streams == {}

    run(main)


def test_a_request_message_that_stalls_ends_its_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A message with bytes missing and none arriving: the call ends (UNAVAILABLE) and what it
    held leaves the budget."""
    from quiver.frontends import grpc_call

    monkeypatch.setattr(grpc_call, "PROGRESS_SECONDS", 0.1)

    async def main() -> None:
        server, _ = _server()
        pair = Pair(server)
        stream_id = pair.client.get_next_available_stream_id()
        pair.client.send_headers(stream_id, _headers("/svc/Echo"))
        pair.client.send_data(stream_id, b"\x00" + (1000).to_bytes(4, "big") + b"x" * 10)
        pair.pump()
        assert server.budget.used == 1005  # the whole message, reserved once admitted
        await asyncio.sleep(0.3)
        (headers,) = of(pair.receive(), h2.events.ResponseReceived)
        assert dict(headers.headers)[b"grpc-status"] == b"14"
        assert server.budget.used == 0

    run(main)


def _connect(server: GrpcServer) -> Pair:
    """A connection the server takes as a listener would (counted against its cap)."""
    return Pair(server, server=server._connection())


def _goaways(pair: Pair) -> list[tuple[int, int]]:
    """(last stream id, error code) of the GOAWAYs the server wrote since the last look (read
    raw: h2 takes the first of gRPC's two GOAWAYs as the end and drops what follows)."""
    return _goaways_of(pair.transport)


def _goaways_of(transport: Any) -> list[tuple[int, int]]:
    return [(f.last_stream_id, f.error_code) for f in frames_of(bytes(transport.out)) if isinstance(f, hf.GoAwayFrame)]


def _ack_goaway_ping(pair: Pair) -> None:
    (ping,) = [f for f in frames_of(bytes(pair.transport.out)) if isinstance(f, hf.PingFrame) and not f.flags]
    pair.transport.out.clear()
    pair.raw(hf.PingFrame(0, ping.opaque_data, flags=["ACK"]).serialize())


def test_at_the_cap_the_connection_idle_the_longest_makes_room() -> None:
    """A connection past the cap: the one idle the longest (not the oldest, which is busy) is
    asked to go as a stop asks (GOAWAY NO_ERROR with the largest id and a PING, then with the
    last stream it opened) and the newcomer is served; a busy connection is left alone; when
    all are busy, the newcomer is refused."""

    async def main() -> None:
        server, _ = _server()
        server.max_connections = 3
        busy = _connect(server)  # the oldest: a call in progress
        busy_stream = busy.request(b"", headers=_headers("/svc/Echo"), end=False)
        busy.pump()
        older, newer = _connect(server), _connect(server)
        for pair in (older, newer):  # each answers a call, then is idle: older first
            stream_id = pair.request(b"\x00\x00\x00\x00\x01a", headers=_headers("/svc/Echo"))
            pair.pump()
            assert await _answer(pair, stream_id) == (b"0", b"\x00\x00\x00\x00\x01a")
            await asyncio.sleep(0.01)
        assert len(server.connections) == 3
        busy.transport.out.clear()
        newer.transport.out.clear()
        older.transport.out.clear()
        newcomer = _connect(server)
        assert not newcomer.transport.closed
        stream_id = newcomer.request(b"\x00\x00\x00\x00\x01b", headers=_headers("/svc/Echo"))
        newcomer.pump()
        assert await _answer(newcomer, stream_id) == (b"0", b"\x00\x00\x00\x00\x01b")
        assert _goaways(older) == [(2**31 - 1, 0)] and not older.transport.closed
        _ack_goaway_ping(older)
        assert _goaways(older) == [(1, 0)]  # the last stream it opened
        assert older.transport.closed
        assert _goaways(busy) == [] and _goaways(newer) == [] and not busy.transport.closed and not newer.transport.closed
        await asyncio.sleep(0)  # connection_lost
        assert older.server not in server.connections and not server._leaving
        # every connection busy: the next one is refused, and the busy ones go on
        newer.request(b"", headers=_headers("/svc/Echo"), end=False)
        newer.pump()
        newcomer.request(b"", headers=_headers("/svc/Echo"), end=False)
        newcomer.pump()
        refused = server._connection()
        from support.h2pair import Transport

        transport = Transport(refused)
        refused.connection_made(transport)
        goaway = [f for f in frames_of(bytes(transport.out)) if isinstance(f, hf.GoAwayFrame)]
        assert transport.closed and goaway[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
        for pair in (busy, newer, newcomer):
            assert _goaways(pair) == [] and not pair.transport.closed
        busy.client.send_data(busy_stream, b"\x00\x00\x00\x00\x01c", end_stream=True)
        busy.pump()
        assert await _answer(busy, busy_stream) == (b"0", b"\x00\x00\x00\x00\x01c")
        # its call over, the oldest connection is the only idle one: the next newcomer takes its place
        busy.transport.out.clear()
        last = _connect(server)
        assert not last.transport.closed and _goaways(busy) == [(2**31 - 1, 0)]

    run(main)


def test_connections_asked_to_go_that_stay_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client asked to go that never answers the PING (or keeps a stream busy) stays open a
    while: at most max(16, cap // 16) such connections make room; past that, newcomers are
    refused until they close."""

    async def main() -> None:
        server, _ = _server()
        server.max_connections = 1
        pairs = [_connect(server) for _ in range(18)]
        refused = [pair.transport.closed for pair in pairs]
        assert refused == [False] * 17 + [True]  # 1 served, 16 leaving, the 18th refused
        assert len(server._leaving) == 16
        for pair in pairs[:16]:
            assert _goaways(pair) == [(2**31 - 1, 0)]
        _ack_goaway_ping(pairs[0])  # one leaves: room for one more
        await asyncio.sleep(0)
        assert len(server._leaving) == 15
        assert not _connect(server).transport.closed

    run(main)


def test_a_connection_without_its_preface_is_asked_to_go_as_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """The connection idle the longest has not yet sent its preface and SETTINGS (the server's
    are out): it is asked to go as any other, not closed at once, so a call its client sent
    meanwhile is served (closed at once, the call failed UNAVAILABLE, with no retry); one that
    never speaks is closed once the PING has waited GOAWAY_PING_SECONDS."""
    monkeypatch.setattr(http2, "GOAWAY_PING_SECONDS", 0.1)

    async def main() -> None:
        server, _ = _server()
        server.max_connections = 1
        young = server._connection()
        transport = Transport(young)
        young.connection_made(transport)  # no preface, no SETTINGS yet
        transport.out.clear()
        newcomer = _connect(server)
        assert not newcomer.transport.closed and not transport.closed
        assert _goaways_of(transport) == [(2**31 - 1, 0)]
        client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        client.initiate_connection()  # its call, on its way when the GOAWAY was sent
        client.send_headers(1, _headers("/svc/Echo"))
        client.send_data(1, b"\x00\x00\x00\x00\x01y", end_stream=True)
        young.data_received(client.data_to_send())
        await asyncio.sleep(0.01)
        frames = frames_of(bytes(transport.out))
        assert [f.data for f in frames if isinstance(f, hf.DataFrame) and f.stream_id == 1] == [b"\x00\x00\x00\x00\x01y"]
        (ping,) = [f for f in frames if isinstance(f, hf.PingFrame) and not f.flags]
        transport.out.clear()
        young.data_received(hf.PingFrame(0, ping.opaque_data, flags=["ACK"]).serialize())
        assert _goaways_of(transport) == [(1, 0)] and transport.closed  # the call it sent, served
        await asyncio.sleep(0)
        assert server.connections == {newcomer.server} and not server._leaving
        silent = server._connection()  # takes the newcomer's place
        silent_transport = Transport(silent)
        silent.connection_made(silent_transport)
        silent_transport.out.clear()
        assert server._leaving == {newcomer.server}
        _connect(server)  # takes the silent one's
        assert _goaways_of(silent_transport) == [(2**31 - 1, 0)] and not silent_transport.closed
        await asyncio.sleep(0.2)  # no PING answer: the final GOAWAY names no stream
        assert _goaways_of(silent_transport) == [(2**31 - 1, 0), (0, 0)] and silent_transport.closed

    run(main)


def test_the_cap_is_half_the_file_descriptors_when_fewer() -> None:
    from quiver.frontends.grpc_server import MAX_CONNECTIONS, MIN_CONNECTIONS, connection_cap

    assert connection_cap(1024) == 512  # the common soft limit: room made before accept() fails
    assert connection_cap(1 << 20) == MAX_CONNECTIONS
    assert connection_cap(10) == MIN_CONNECTIONS
    assert connection_cap(resource.RLIM_INFINITY) == MAX_CONNECTIONS
    assert _server()[0].max_connections == connection_cap(resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def test_idle_connections_are_sent_away(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http2_guard, "IDLE_SECONDS", 0.1)
    monkeypatch.setattr(http2_guard, "HOUSEKEEPING_SECONDS", 0.05)

    async def main() -> None:
        server, _ = _server()
        kept = _connect(server)
        await asyncio.sleep(0.3)  # no stream for longer than the idle limit: GOAWAY (NO_ERROR)
        assert _goaways(kept)[0] == (2**31 - 1, 0)

    run(main)


@pytest.mark.parametrize("length", [65_531, 70_000, 81_000, 150_000])
def test_a_message_just_past_a_stream_window_gets_all_its_credit(length: int) -> None:
    """A message a little larger than the stream's window (what is missing smaller than a
    quarter window) is admitted and its window opened for all of it, however its bytes come
    in: the client never waits for credit that does not come (a stall that only a deadline
    ended)."""

    async def main() -> None:
        server, _ = _server(max_message=4 * MB)
        body = b"\x00" + length.to_bytes(4, "big") + bytes(range(256)) * (length // 256) + bytes(length % 256)
        for first in (5, 1000, 16_384):  # how much of the message the first DATA frame carries
            pair = Pair(server)
            stream_id = pair.client.get_next_available_stream_id()
            pair.client.send_headers(stream_id, _headers("/svc/Echo"))
            sent = _fill(pair, stream_id, body[:first])
            sent += _fill(pair, stream_id, body[sent:])
            assert sent == len(body), f"{len(body) - sent} bytes never got credit (first frame {first})"
            pair.client.end_stream(stream_id)
            for _ in range(30):  # the answer is as large: it comes as the client gives credit
                for event in of(pair.pump(), h2.events.DataReceived):
                    pair.client.acknowledge_received_data(event.flow_controlled_length, stream_id)
                await asyncio.sleep(0)
            answer = b"".join(e.data for e in of(pair.events, h2.events.DataReceived) if e.stream_id == stream_id)
            assert answer == body
            assert server.budget.used == 0

    run(main)


def _send_all(pair: Pair, stream_id: int, data: bytes, frame_size: int = 16384, pad: int | None = None) -> bool:
    """Send all of ``data`` (then END_STREAM) as the server's windows allow; False when the
    windows stay shut although the server has everything sent so far."""
    sent, cost = 0, 0 if pad is None else pad + 1
    while sent < len(data):
        room = min(pair.client.local_flow_control_window(stream_id) - cost, frame_size, len(data) - sent)
        if room <= 0:
            if not of(pair.pump(), h2.events.WindowUpdated):
                return False
            continue
        pair.client.send_data(stream_id, data[sent : sent + room], end_stream=sent + room == len(data), pad_length=pad)
        sent += room
    pair.pump()
    return True


async def _answer(pair: Pair, stream_id: int) -> tuple[bytes, bytes]:
    """The answer's grpc-status and body (the client's windows opened as it comes)."""
    body = bytearray()
    for _ in range(50):
        await asyncio.sleep(0)
        for event in pair.receive() + pair.pump():
            if isinstance(event, h2.events.DataReceived) and event.stream_id == stream_id:
                body += event.data
                pair.client.acknowledge_received_data(event.flow_controlled_length, stream_id)
            elif isinstance(event, h2.events.TrailersReceived) and event.stream_id == stream_id:
                return dict(event.headers)[b"grpc-status"], bytes(body)
    raise AssertionError("no answer")


@pytest.mark.parametrize("length", [65_530, 65_531, 65_600, 70_000, 81_913, 81_914, 81_915, 100_000])
def test_a_message_a_little_past_a_stream_window_is_credited_whole(length: int) -> None:
    """A message admitted with less than a quarter of a stream window missing still gets the
    credit it needs (65.5-81.9 kB requests used to wait for a WINDOW_UPDATE that never came)."""

    async def main() -> None:
        server, _ = _server()
        pair = Pair(server)
        stream_id = pair.client.get_next_available_stream_id()
        pair.client.send_headers(stream_id, _headers("/svc/Echo"))
        message = b"\x00" + length.to_bytes(4, "big") + b"q" * length
        assert _send_all(pair, stream_id, message)
        assert await _answer(pair, stream_id) == (b"0", message)

    run(main)


def test_padding_is_credited_to_a_message_being_received() -> None:
    """DATA padding counts against the windows (RFC 9113 6.1): a message sent in small padded
    frames gets the credit the padding took."""

    async def main() -> None:
        server, _ = _server()
        pair = Pair(server)
        stream_id = pair.client.get_next_available_stream_id()
        pair.client.send_headers(stream_id, _headers("/svc/Echo"))
        message = b"\x00" + (20_000).to_bytes(4, "big") + b"p" * 20_000
        assert _send_all(pair, stream_id, message, frame_size=20, pad=200)
        assert await _answer(pair, stream_id) == (b"0", message)

    run(main)


async def _open(pair: Pair, count: int) -> list[int]:
    """``count`` streams of /svc/Echo opened (their requests not begun)."""
    streams = []
    for number in range(count):
        stream_id = pair.client.get_next_available_stream_id()
        pair.client.send_headers(stream_id, _headers("/svc/Echo"))
        streams.append(stream_id)
        if number % 50 == 49:
            pair.pump()
            await asyncio.sleep(0)  # (a read opens at most 64 streams before others get a turn)
    pair.pump()
    await asyncio.sleep(0)
    return streams


def _begin(pair: Pair, streams: list[int], length: int = 4 * MB, size: int = 100) -> None:
    """Each of ``streams`` sends the first ``size`` bytes of a ``length`` message (those the
    server refused meanwhile are skipped)."""
    data = b"\x00" + length.to_bytes(4, "big") + b"s" * (size - 5)
    for stream_id in streams:
        try:
            for at in range(0, size, 16384):
                pair.client.send_data(stream_id, data[at : at + 16384])
        except h2.exceptions.StreamClosedError:
            continue
        pair.pump()


async def _starve(pair: Pair, count: int, length: int = 4 * MB, size: int = 100) -> list[int]:
    streams = await _open(pair, count)
    _begin(pair, streams, length, size)
    return streams


def test_calls_waiting_for_the_budget_cost_no_more_to_end_than_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Messages waiting for room in the budget are looked at again once per turn of the event
    loop that freed some, in order, each connection's up to its first that still does not fit:
    a connection closing with hundreds waiting costs work in proportion to them, not to their
    square (every call's end used to look at every waiting message again)."""
    from quiver.frontends import grpc_receive

    looks = [0]
    credit = grpc_receive.RequestBuffer.credit

    def counted(self: grpc_receive.RequestBuffer) -> None:
        looks[0] += 1
        credit(self)

    monkeypatch.setattr(grpc_receive.RequestBuffer, "credit", counted)

    async def main() -> None:
        server, _ = _server(max_message=4 * MB)
        pairs = [Pair(server) for _ in range(2)]
        waiting = [await _starve(pair, 300) for pair in pairs]
        assert sum(1 for pair in pairs for s in pair.server.streams.values() if s.handler._request._admitted) == 2  # type: ignore[union-attr]
        looks[0] = 0
        pairs[0].transport.close()  # its 300 calls end
        for _ in range(5):
            await asyncio.sleep(0)
        assert not pairs[0].server.streams and server.budget.used == pairs[1].server.buffered
        assert looks[0] < 50
        # the budget's room goes to the other connection's next message
        first = waiting[1][0]
        pairs[1].client.reset_stream(first)
        pairs[1].pump()
        for _ in range(5):
            await asyncio.sleep(0)
        assert pairs[1].server.streams[waiting[1][1]].handler._request._admitted == 4 * MB + 5  # type: ignore[union-attr]
        assert looks[0] < 100

    run(main)


def test_request_bytes_past_the_server_wide_budget_are_refused_whatever_the_connections() -> None:
    """Many connections, each within its share, with streams that send the start of messages
    the budget has no room for: what is held stays within the server-wide budget (the windows
    each stream was granted used to let every connection hold 64 KiB a stream past it); the
    calls whose bytes found no room are refused (nothing of them ran: clients may retry), the
    admitted messages go on."""

    async def main() -> None:
        server, _ = _server(max_message=4 * MB)
        server.budget.limit = 1 * MB
        pairs = [Pair(server) for _ in range(4)]
        opened = [await _open(pair, 8) for pair in pairs]  # all open before the budget fills
        for pair, streams in zip(pairs, opened, strict=True):
            _begin(pair, streams, length=200_000, size=60_000)
        held = sum(s.handler._request.pending() for pair in pairs for s in pair.server.streams.values()  # type: ignore[union-attr]
                   if s.handler is not None and s.handler._request is not None)  # type: ignore[attr-defined]
        assert server.budget.used <= server.budget.limit and held <= server.budget.limit
        refused = [e for pair in pairs for e in of(pair.events, h2.events.StreamReset)]
        assert len(refused) >= 16 and {e.error_code for e in refused} == {h2.errors.ErrorCodes.REFUSED_STREAM}
        admitted = [s.id for s in pairs[0].server.streams.values() if s.handler._request._admitted]  # type: ignore[union-attr]
        assert len(admitted) >= 2
        assert _send_all(pairs[0], admitted[0], b"a" * (200_005 - 60_000))  # an admitted message finishes
        assert await _answer(pairs[0], admitted[0]) == (b"0", b"\x00" + (200_000).to_bytes(4, "big") + b"s" * 59_995 + b"a" * 140_005)

    run(main)


def test_a_streaming_call_whose_bytes_find_no_room_ends_resource_exhausted() -> None:
    async def main() -> None:
        server, _ = _server(max_message=4 * MB)
        server.budget.limit = 100_000
        pair = Pair(server)
        stream_id = pair.client.get_next_available_stream_id()
        pair.client.send_headers(stream_id, _headers("/svc/Stream"))
        pair.pump()
        await asyncio.sleep(0)
        await _starve(pair, 1, length=200_000, size=100)  # admitted: it holds the budget
        assert server.budget.used == 200_005
        pair.client.send_data(stream_id, b"\x00\x00\x00\x00\x03ab")
        pair.pump()
        (trailers,) = [e for e in of(pair.events, h2.events.ResponseReceived) if e.stream_id == stream_id]
        assert dict(trailers.headers)[b"grpc-status"] == b"8"  # RESOURCE_EXHAUSTED
        assert server.budget.used == 200_005

    run(main)


def test_calls_in_progress_are_bounded_server_wide() -> None:
    """Each connection may have its streams, but the calls in progress on all of them are
    bounded (a call holds a task and its state before any request byte: 40 connections of
    1,024 streams each, HEADERS alone, held 410 MB); past the bound new streams are refused,
    and taken again once calls end."""

    async def main() -> None:
        server, _ = _server()
        server.max_calls = 5
        pairs = [Pair(server) for _ in range(2)]
        opened = [await _open(pair, 4) for pair in pairs]
        refused = [(e.stream_id, e.error_code) for e in of(pairs[1].events, h2.events.StreamReset)]
        assert refused == [(opened[1][1], h2.errors.ErrorCodes.REFUSED_STREAM), (opened[1][2], h2.errors.ErrorCodes.REFUSED_STREAM),
                           (opened[1][3], h2.errors.ErrorCodes.REFUSED_STREAM)]
        assert server.calls == 5
        pairs[0].client.send_data(opened[0][0], b"\x00\x00\x00\x00\x01a", end_stream=True)  # a call ends
        pairs[0].pump()
        assert await _answer(pairs[0], opened[0][0]) == (b"0", b"\x00\x00\x00\x00\x01a")
        assert server.calls == 4
        assert len(await _open(pairs[1], 1)) == 1 and not of(pairs[1].events, h2.events.StreamReset)[3:]
        pairs[0].transport.close()  # its calls end with it
        await asyncio.sleep(0)
        assert server.calls == 2

    run(main)


def test_answers_waiting_for_window_are_bounded_on_all_connections() -> None:
    """Clients that never open their windows, on many connections, each within its own
    limit (6 connections held 432 MB of answers for a minute): past the bound on all of them,
    new streams are refused; once answers go out or their streams end, streams are taken again."""

    async def main() -> None:
        server, _ = _server()
        server.max_pending_send = 150_000
        shut = {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0}
        pairs = [Pair(server, shut) for _ in range(3)]
        streams = []
        for pair in pairs:
            stream_id = pair.client.get_next_available_stream_id()
            pair.client.send_headers(stream_id, _headers("/svc/Big"))
            pair.client.send_data(stream_id, b"\x00\x00\x00\x00\x01a", end_stream=True)
            pair.pump()
            for _ in range(10):
                await asyncio.sleep(0)
            streams.append(stream_id)
        assert server.pending_send == 200_010  # the first two answers wait; the third was refused
        refused = of(pairs[2].events, h2.events.StreamReset)
        assert [(e.stream_id, e.error_code) for e in refused] == [(streams[2], h2.errors.ErrorCodes.REFUSED_STREAM)]
        pairs[0].transport.close()  # its answer is dropped with it
        await asyncio.sleep(0)
        assert server.pending_send == 100_005
        pairs[1].client.reset_stream(streams[1])
        pairs[1].pump()
        assert server.pending_send == 0
        stream_id = pairs[2].client.get_next_available_stream_id()
        pairs[2].client.send_headers(stream_id, _headers("/svc/Echo"))
        pairs[2].pump()
        assert len(of(pairs[2].events, h2.events.StreamReset)) == 1

    run(main)


def test_a_stream_whose_answers_are_not_taken_stops_reading_requests() -> None:
    """ModelStreamInfer with a client that sends requests and never reads the answers: the
    requests in progress and the answers queued for the writer count against the stream's
    window together, so the reader stops (a million empty requests queued 86 MB of error
    answers: each request's place came back when its answer was queued, not when it was sent)."""
    from quiver.errors import InvalidArgumentError
    from quiver.frontends.grpc_stream import STREAM_WINDOW, serve_stream

    class Servicer:
        service = None

        def _enter(self) -> None: ...

        def _leave(self) -> None: ...

        async def decode(self, data: bytes, context: Any = None) -> Any:
            raise InvalidArgumentError("malformed ModelInferRequest message")

    pulled = 0

    async def requests() -> Any:
        nonlocal pulled
        for _ in range(10 * STREAM_WINDOW):
            pulled += 1
            yield b"\x00"

    async def main() -> None:
        answers = serve_stream(Servicer(), requests())  # type: ignore[arg-type]
        first = await answers.__anext__()  # the writer takes one answer, then its client stalls
        assert b"malformed" in first
        for _ in range(200):
            await asyncio.sleep(0)
        assert pulled <= STREAM_WINDOW + 2
        rest = [answer async for answer in answers]  # the client reads again: every request answered
        assert len(rest) == 10 * STREAM_WINDOW - 1 and pulled == 10 * STREAM_WINDOW

    run(main)


def test_connections_not_yet_made_count_until_made_or_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection accepted whose TLS handshake is under way counts against the cap, but is
    not among the connections (no transport yet: a stop leaves it alone, and asks it to go
    once it is made); one the TLS layer drops (its handshake failed: never made, never
    closed) no longer counts, nor one past its time."""

    async def main() -> None:
        server, _ = _server()
        server.max_connections = 2
        busy = _connect(server)
        busy.request(b"", headers=_headers("/svc/Echo"), end=False)
        busy.pump()
        unmade = server._connection()
        assert server.connections == {busy.server}
        assert server._connection()._refused  # the cap: one made and busy, one under way
        del unmade  # dropped by the TLS layer
        gc.collect()
        assert not server._connection()._refused
        monkeypatch.setattr(grpc_server, "UNMADE_SECONDS", 0.05)
        server._unmade.clear()
        held = server._connection()
        assert server._connection()._refused
        await asyncio.sleep(0.1)  # its time is up
        assert not server._connection()._refused
        server._unmade.clear()
        late = server._connection()
        server.begin_stop()  # no transport yet: nothing to say to it
        transport = Transport(late)
        late.connection_made(transport)
        assert _goaways_of(transport) == [(2**31 - 1, 0)]  # made after the stop began: asked to go at once
        await server.close(1.0)
        assert not server.connections and held is not None

    run(main)


def test_a_closed_connection_whose_client_takes_nothing_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing waits for what the transport still holds to be written: a connection asked to
    go whose client reads nothing would never be lost, and hold its place among those leaving
    for good. One whose client takes nothing for CLOSE_STALL_SECONDS is cut off (abort); one
    whose client still takes some is left to finish."""
    monkeypatch.setattr(http2, "CLOSE_STALL_SECONDS", 0.3)

    async def main() -> None:
        server, _ = _server()
        server.max_connections = 1
        stuck, slow = _connect(server), _connect(server)  # slow makes stuck leave
        _connect(server)  # and the newcomer makes slow leave
        for pair in (stuck, slow):
            pair.transport.stuck, pair.transport.unsent = True, 1000
            _ack_goaway_ping(pair)  # the final GOAWAY: closed, with what is left unsent
            assert pair.transport.closed
        assert server._leaving == {stuck.server, slow.server}
        for left in range(950, 0, -50):  # slow takes some six times as often as it is looked at
            slow.transport.unsent = left
            await asyncio.sleep(0.05)
        assert stuck.transport.aborted and not slow.transport.aborted
        assert server._leaving == {slow.server}
        await asyncio.sleep(0.7)  # slow took nothing more
        assert slow.transport.aborted and not server._leaving

    run(main)


def test_closing_a_server_whose_client_reads_nothing_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a real socket: a client that asked for a large answer and reads none of it; the
    server's close ends the connection (abort once the unsent answer has stood still)."""
    monkeypatch.setattr(http2, "CLOSE_STALL_SECONDS", 0.3)

    async def main() -> None:
        size = 48 * MB

        async def huge(data: bytes, context: Any) -> bytes:
            return bytes(size)

        server = GrpcServer({"/svc/Huge": RpcMethod("/svc/Huge", huge)}, max_receive_message_size=MB,
                            max_send_message_size=size + MB)
        port = await server.start("127.0.0.1", 0)
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)  # reads 128 KiB at most
        client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        client.initiate_connection()
        client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
        client.increment_flow_control_window(2**31 - 1 - 65_535)
        client.send_headers(1, _headers("/svc/Huge"))
        client.send_data(1, b"\x00\x00\x00\x00\x00", end_stream=True)
        writer.write(client.data_to_send())
        await writer.drain()
        for _ in range(100):  # the answer is written (what the socket did not take, held by the transport)
            await asyncio.sleep(0.05)
            (connection,) = server.connections
            if not connection.streams and connection.transport.get_write_buffer_size():
                break
        assert connection.transport.get_write_buffer_size() > 0
        started = asyncio.get_running_loop().time()
        await server.close(5.0)
        assert not server.connections and asyncio.get_running_loop().time() - started < 2.0
        writer.close()

    run(main)


def test_a_connection_whose_reset_call_still_works_is_not_asked_to_go_until_it_ends() -> None:
    """The client resets a call whose handler goes on working (it ignores the cancel): the
    connection has no stream open but is not idle, so a newcomer at the cap is refused; once
    the handler ends the connection is idle again, and the next newcomer takes its place."""

    async def main() -> None:
        release: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def stubborn(data: bytes, context: Any) -> bytes:
            try:
                await asyncio.shield(release)
            except asyncio.CancelledError:
                await release  # keeps working after the cancel
            return data

        server = GrpcServer({"/svc/Stubborn": RpcMethod("/svc/Stubborn", stubborn)}, max_receive_message_size=MB,
                            max_send_message_size=MB, max_connections=1)
        zombie = _connect(server)
        stream_id = zombie.request(b"\x00\x00\x00\x00\x01a", headers=_headers("/svc/Stubborn"))
        zombie.pump()
        await asyncio.sleep(0.01)
        zombie.client.reset_stream(stream_id)
        zombie.pump()
        await asyncio.sleep(0.01)
        assert not zombie.server.streams and zombie.server.working
        refused = server._connection()  # the zombie's call still works: no room
        assert refused._refused
        zombie.transport.out.clear()
        release.set_result(None)
        await asyncio.sleep(0.01)
        assert not zombie.server.working
        newcomer = _connect(server)
        assert not newcomer.transport.closed and not newcomer.server._refused
        assert _goaways(zombie) == [(2**31 - 1, 0)]

    run(main)


def test_connections_that_never_speak_cannot_hold_newcomers_off() -> None:
    """A connection whose client has sent not one byte for SILENT_SECONDS is closed at once to
    make room (a gRPC client sends its preface as it connects), not asked to go: asked, each
    held a place among those leaving for the final GOAWAY's wait, and once max(16, cap/16) of
    them were leaving every newcomer was refused."""

    async def main() -> None:
        server, _ = _server()
        server.max_connections = 1
        transports = []
        for _ in range(40):
            silent = server._connection()
            transport = Transport(silent)
            silent.connection_made(transport)
            assert not _goaways_of(transport), "refused: a silent connection held the newcomer off"
            transport.out.clear()
            silent.made_at -= grpc_server.SILENT_SECONDS  # it has said nothing for that long
            transports.append(transport)
        for transport in transports[:-1]:  # each closed at once by the next, no GOAWAY
            assert transport.closed and not _goaways_of(transport)
        assert not transports[-1].closed
        await asyncio.sleep(0)
        assert len(server.connections) == 1 and not server._leaving

    run(main)


def test_a_closed_connection_whose_client_trickles_is_cut_off_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that takes a little of what is left every look keeps a closed connection only
    until CLOSE_DEADLINE_SECONDS after its close."""
    monkeypatch.setattr(http2, "CLOSE_STALL_SECONDS", 0.05)
    monkeypatch.setattr(http2, "CLOSE_DEADLINE_SECONDS", 0.4)

    async def main() -> None:
        server, _ = _server()
        pair = _connect(server)
        pair.transport.stuck, pair.transport.unsent = True, 100_000
        started = asyncio.get_running_loop().time()
        pair.server.abort()
        while not pair.transport.aborted and asyncio.get_running_loop().time() - started < 3:
            pair.transport.unsent -= 10  # a byte or ten at a time, never stalled
            await asyncio.sleep(0.01)
        assert pair.transport.aborted
        assert 0.35 <= asyncio.get_running_loop().time() - started < 1.5

    run(main)


def test_a_closed_tls_connection_is_left_to_the_tls_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over TLS the transport's write buffer is the TLS layer's alone (what it passed to the
    socket is not in it): it reads 0 while the client still reads, so the close is left to the
    TLS transport's own shutdown timeout (the listener's, CLOSE_DEADLINE_SECONDS), not cut when
    that buffer seems to stand still."""
    monkeypatch.setattr(http2, "CLOSE_STALL_SECONDS", 0.05)

    async def main() -> None:
        server, _ = _server()
        pair = _connect(server)
        monkeypatch.setattr(pair.transport, "get_extra_info", lambda name, default=None: object() if name == "sslcontext" else default)
        pair.transport.stuck = True  # the TLS layer's buffer: empty, the rest below it
        pair.server.abort()
        await asyncio.sleep(0.3)
        assert pair.transport.closed and not pair.transport.aborted

    run(main)
