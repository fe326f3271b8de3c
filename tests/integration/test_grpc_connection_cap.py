"""Quiver's gRPC server at its connection cap, on the wire: a newcomer is served by asking the
connection idle the longest to go (GOAWAY NO_ERROR, then the last stream it opened, then
close), a busy connection is never asked, every connection busy refuses the newcomer, and a
``tritonclient.grpc`` client whose connection was taken reconnects when it next calls.

The server is the real ``quiver serve`` with its cap lowered to :data:`CAP` (the constant
``grpc_server.MAX_CONNECTIONS``, set before the server starts: there is no flag for it, as
Triton has none)."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from build_repository import SIMPLE_CONFIG, simple_onnx
from grpc_health.v1 import health_pb2
from tritonclient.grpc import service_pb2 as pb

from support.h2grpc import RawGrpc, framed
from support.models import write_onnx
from support.server import QuiverServer
from support.tls import certificates

CAP = 3
WATCH = "/grpc.health.v1.Health/Watch"
NO_ERROR, ENHANCE_YOUR_CALM = 0x0, 0xB
GOAWAY, PING = 0x7, 0x6


class CappedServer(QuiverServer):
    """``quiver serve`` with the gRPC server's connection cap at ``cap`` (default :data:`CAP`),
    or with its limit of file descriptors (soft and hard) at ``descriptors``."""

    def __init__(self, *args: Any, cap: int | None = CAP, descriptors: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cap, self.descriptors = cap, descriptors

    def command(self) -> list[str]:
        python, flag, module, *args = super().command()
        assert (flag, module) == ("-m", "quiver")
        launch = "import resource, runpy, quiver.frontends.grpc_server as s; "
        if self.cap is not None:
            launch += f"s.MAX_CONNECTIONS = {self.cap}; "
        if self.descriptors is not None:
            # soft and hard: the server raises its soft limit to the hard one at start
            launch += f"resource.setrlimit(resource.RLIMIT_NOFILE, ({self.descriptors}, {self.descriptors})); "
        launch += "runpy.run_module('quiver', run_name='__main__', alter_sys=True)"
        return [python, "-c", launch, *args]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("grpc-cap")
    write_onnx(repo, "simple", simple_onnx(), SIMPLE_CONFIG)
    return repo


@pytest.fixture
def server(repository: Path) -> Iterator[QuiverServer]:
    """A server per test: what one test leaves open must not fill the next one's cap."""
    with CappedServer(repository, args=("--grpc-server", "quiver")) as running:
        yield running


def _frames(sock: socket.socket, buffer: bytearray, timeout: float) -> list[tuple[int, bytes]]:
    """(type, payload) of the whole frames read within ``timeout`` (none: the server sent nothing)."""
    sock.settimeout(timeout)
    try:
        chunk = sock.recv(1 << 16)
    except TimeoutError:
        return []
    if not chunk:
        raise EOFError
    buffer += chunk
    found = []
    while len(buffer) >= 9 and len(buffer) >= 9 + (length := int.from_bytes(buffer[:3], "big")):
        found.append((buffer[3], bytes(buffer[9 : 9 + length])))
        del buffer[: 9 + length]
    return found


def _sent_away(raw: RawGrpc) -> list[tuple[int, int]]:
    """Read a connection to its end, answering the server's PINGs: the (last stream id, error
    code) of each GOAWAY it got. Raw frames: h2 takes the first of gRPC's two GOAWAYs as the
    end and refuses the PING that follows it."""
    buffer, goaways = bytearray(), []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            frames = _frames(raw.sock, buffer, 1.0)
        except (EOFError, ConnectionResetError):
            return goaways
        for kind, payload in frames:
            if kind == GOAWAY:
                goaways.append((int.from_bytes(payload[:4], "big") & 0x7FFFFFFF, int.from_bytes(payload[4:8], "big")))
            elif kind == PING:
                raw.sock.sendall(bytes((0, 0, 8, PING, 1, 0, 0, 0, 0)) + payload)
    raise AssertionError(f"the connection was not closed; GOAWAYs {goaways}")


def _quiet(raw: RawGrpc) -> bool:
    """Whether the server sends this connection nothing for a while (no GOAWAY)."""
    return _frames(raw.sock, bytearray(), 0.5) == []


def _watching(port: int) -> RawGrpc:
    """A connection busy with a health Watch (a call that lasts until the client ends it)."""
    raw = RawGrpc(port)
    stream_id = raw.start(WATCH)
    raw.send(stream_id, framed(health_pb2.HealthCheckRequest(service="").SerializeToString()))
    while not raw.replies[stream_id].body:
        raw.read()
    return raw


def _idle(port: int) -> RawGrpc:
    """A connection that made a call (stream 1) and is now idle."""
    raw = RawGrpc(port)
    assert raw.call("ServerLive", b"").status == 0
    return raw


def _infer(client: grpcclient.InferenceServerClient) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result: Any = client.infer("simple", inputs, client_timeout=10)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_a_newcomer_is_served_and_the_connection_idle_the_longest_goes(server: QuiverServer) -> None:
    busy = _watching(server.grpc_port)  # the oldest connection, busy
    older, newer = _idle(server.grpc_port), _idle(server.grpc_port)
    client = grpcclient.InferenceServerClient(server.grpc_url)  # past the cap
    try:
        assert client.is_server_live(client_timeout=10)
        _infer(client)
        # the first GOAWAY names no stream (a call on its way is served), the second the last
        # stream the connection opened (its ServerLive, stream 1); then the server closes it
        assert _sent_away(older) == [(2**31 - 1, NO_ERROR), (1, NO_ERROR)]
        assert _quiet(busy) and _quiet(newer)
        assert busy.call("ServerLive", b"").status == 0 and newer.call("ServerLive", b"").status == 0
    finally:
        client.close()
        for raw in (busy, older, newer):
            raw.close()


def test_when_every_connection_is_busy_the_newcomer_is_refused(server: QuiverServer) -> None:
    busy = [_watching(server.grpc_port) for _ in range(CAP)]
    try:
        with socket.create_connection(("127.0.0.1", server.grpc_port), timeout=20) as sock:
            sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes((0, 0, 0, 4, 0, 0, 0, 0, 0)))
            buffer, goaway = bytearray(), b""
            with pytest.raises((EOFError, ConnectionResetError)):  # closed by the server
                for _ in range(20):
                    for kind, payload in _frames(sock, buffer, 1.0):
                        goaway = payload if kind == GOAWAY else goaway
        assert int.from_bytes(goaway[4:8], "big") == ENHANCE_YOUR_CALM
        assert b"too many connections" in goaway[8:]
        for raw in busy:  # untouched: no GOAWAY, and they still take calls
            assert _quiet(raw)
            assert raw.call("ServerLive", b"").status == 0
    finally:
        for raw in busy:
            raw.close()


def test_tritonclient_reconnects_when_its_connection_was_taken(server: QuiverServer) -> None:
    """Round after round, the client is the connection idle the longest when a newcomer comes:
    its connection is taken, and its next call (at once, or once the close has happened) just
    works on a new connection, which in turn takes the place of the longest idle one."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    others: list[RawGrpc] = []
    try:
        _infer(client)
        others = [_idle(server.grpc_port) for _ in range(CAP - 1)]  # the cap is full
        for round_ in range(4):
            newcomer = _idle(server.grpc_port)  # takes the client's connection
            others.append(newcomer)
            if round_ % 2:
                time.sleep(0.5)  # the client has seen both GOAWAYs and the close
            _infer(client)  # at once: on a new connection, or on the old one before its final GOAWAY
            time.sleep(0.5)
            _infer(client)  # on a new connection, which took the place of the longest idle
            gone = others.pop(0)
            last = gone.conn.highest_outbound_stream_id
            assert _sent_away(gone) == [(2**31 - 1, NO_ERROR), (last, NO_ERROR)]
            gone.close()
            for raw in others:  # they call after the client: it is again the longest idle
                assert raw.call("ServerLive", b"").status == 0
        assert client.is_model_ready("simple")
    finally:
        client.close()
        for raw in others:
            raw.close()


def test_with_few_file_descriptors_idle_connections_still_make_room(repository: Path) -> None:
    """With a limit of 256 file descriptors (soft and hard) the cap is 128 connections: 300 clients that
    each call once and stay connected (idle) are all served, each newcomer taking the place of
    the connection idle the longest, where accept() would otherwise have failed for want of a
    descriptor (asyncio stops the listener for a second at a time) and newcomers waited for
    the 10-minute idle limit; the first client, long since sent away, calls again."""
    with CappedServer(repository, args=("--grpc-server", "quiver"), cap=None, descriptors=256) as server:
        channels = []
        try:
            for _ in range(300):
                # a connection of its own per channel (grpcio shares them between alike channels)
                channel = grpc.insecure_channel(server.grpc_url, options=[("grpc.use_local_subchannel_pool", 1)])
                channels.append(channel)
                live = channel.unary_unary(
                    "/inference.GRPCInferenceService/ServerLive",
                    request_serializer=pb.ServerLiveRequest.SerializeToString,
                    response_deserializer=pb.ServerLiveResponse.FromString,
                )
                assert live(pb.ServerLiveRequest(), timeout=10).live
            assert live(pb.ServerLiveRequest(), timeout=10).live
            first = channels[0].unary_unary(
                "/inference.GRPCInferenceService/ServerLive",
                request_serializer=pb.ServerLiveRequest.SerializeToString,
                response_deserializer=pb.ServerLiveResponse.FromString,
            )
            assert first(pb.ServerLiveRequest(), timeout=10).live
            assert "out of system resource" not in server.log
        finally:
            for channel in channels:
                channel.close()


def test_tls_probes_and_failed_handshakes_take_no_place(repository: Path, tmp_path: Path) -> None:
    """On a TLS port, connections whose TLS handshake never ends well (a load balancer's TCP
    check that connects and closes, a client that speaks plain HTTP/2) are never made: they
    hold no place under the cap (twice the cap of each, then a real TLS client is served),
    and neither they nor a handshake under way at the stop hold the stop."""
    files = certificates(tmp_path)
    args = ("--grpc-server", "quiver", "--grpc-use-ssl=true", f"--grpc-server-cert={files['server.crt']}",
            f"--grpc-server-key={files['server.key']}")
    server = CappedServer(repository, args=args)
    with server:
        address = ("127.0.0.1", server.grpc_port)
        for _ in range(2 * CAP):
            with socket.create_connection(address, timeout=10):
                pass  # a TCP health check
            with socket.create_connection(address, timeout=10) as sock:  # no TLS: the handshake fails
                sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes((0, 0, 0, 4, 0, 0, 0, 0, 0)))
                with contextlib.suppress(OSError):
                    while sock.recv(1 << 16):
                        pass
        client = grpcclient.InferenceServerClient(
            f"localhost:{server.grpc_port}", ssl=True, root_certificates=str(files["ca.crt"])
        )
        try:
            assert client.is_server_live(client_timeout=10)
            _infer(client)
        finally:
            client.close()
        with socket.create_connection(address, timeout=10):  # a TLS handshake under way at the stop
            started = time.monotonic()
            assert server.stop(timeout=20) == 0
            assert time.monotonic() - started < 10
        assert "Traceback" not in server.log
