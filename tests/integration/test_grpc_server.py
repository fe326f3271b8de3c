"""Quiver's own gRPC server (``--grpc-server quiver``) on the wire: HTTP/2 flow control both
ways, cancellation and deadlines reaching the model, ``-bin`` metadata, bad bytes answered with
GOAWAY while other connections go on, size limits, gzip and deflate, the health service,
keepalive pings, connection age and mutual TLS. The real tritonclient and grpcio where they
can show it; an ``h2`` client (tests/support/h2grpc.py) for what they cannot."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import h2.events
import hpack
import hyperframe.frame as hf
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from build_repository import SIMPLE_CONFIG, simple_onnx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from support.decoupled_models import build_decoupled_repository
from support.h2grpc import RawGrpc, framed
from support.models import write_identities, write_onnx, write_python
from support.server import QuiverServer
from support.tls import certificates

LIMIT = 1 << 20

ECHO_PARAMETERS = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("PARAMETERS", np.array([r.parameters().encode()], dtype=object))])
            for r in requests
        ]
"""

ECHO_CONFIG = """
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "PARAMETERS" data_type: TYPE_STRING dims: [ 1 ] } ]
"""


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = build_decoupled_repository(tmp_path_factory.mktemp("grpc-server"))
    write_identities(repo, ["FP32"])
    write_onnx(repo, "simple", simple_onnx(), SIMPLE_CONFIG)
    write_python(repo, "echo", ECHO_PARAMETERS, ECHO_CONFIG)
    return repo


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[QuiverServer]:
    args = (
        "--grpc-server", "quiver", "--grpc-max-message-size", str(LIMIT),
        "--grpc-infer-response-compression-level", "high", "--grpc-header-forward-pattern", "^x-app-",
    )
    with QuiverServer(repository, args=args) as running:
        yield running


@pytest.fixture
def raw(server: QuiverServer) -> Iterator[RawGrpc]:
    client = RawGrpc(server.grpc_port)
    yield client
    client.close()


def identity_request(values: np.ndarray[Any, Any]) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="identity_fp32")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=list(values.shape))
    request.raw_input_contents.append(values.tobytes())
    return request


def count_request(model: str, mode: str) -> bytes:
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="COUNT", datatype="INT32", shape=[1])
    request.raw_input_contents.append(np.array([0], dtype=np.int32).tobytes())
    request.parameters["mode"].string_param = mode
    return request.SerializeToString()  # type: ignore[no-any-return]


def remembered(server: QuiverServer) -> bytes:
    """What sender_plain remembers of its last ``wait_cancel`` request (b"cancelled" once it saw it)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    count = grpcclient.InferInput("COUNT", [1], "INT32")
    count.set_data_from_numpy(np.array([0], dtype=np.int32))
    deadline, value = time.monotonic() + 30, b""
    while time.monotonic() < deadline and value != b"cancelled":
        value = client.infer("sender_plain", [count], parameters={"mode": "report"}).as_numpy("TEXT")[0]
        time.sleep(0.05)
    return value  # type: ignore[no-any-return]


def test_a_request_over_many_frames_and_an_answer_past_the_clients_window(server: QuiverServer) -> None:
    """800 KB in: about fifty 16 KiB DATA frames. 800 KB out to a client whose windows are
    HTTP/2's initial 64 KiB: the server sends no more than the window until the client gives
    credit, then the rest, then the trailers."""
    values = np.arange(200_000, dtype=np.float32)
    raw = RawGrpc(server.grpc_port, auto_ack=False)
    try:
        stream_id = raw.start("ModelInfer")
        message = framed(identity_request(values).SerializeToString())
        raw.send(stream_id, message)
        sent_frames = len(message) // raw.conn.max_outbound_frame_size
        assert sent_frames >= 48
        reply = raw.replies[stream_id]
        while len(reply.body) < 65535 and not reply.ended:
            raw.read()
        raw.sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            raw.read()  # nothing more comes until the client gives credit
        assert len(reply.body) == 65535 and not reply.trailers
        raw.sock.settimeout(30)
        while not reply.ended:
            for event in [e for e in raw.events if isinstance(e, h2.events.DataReceived)]:
                raw.conn.acknowledge_received_data(event.flow_controlled_length, stream_id)
            raw.events.clear()
            raw.flush()
            raw.read()
        assert reply.status == 0
        (answer,) = reply.messages()
        response = pb.ModelInferResponse.FromString(answer)
        np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], dtype=np.float32), values)
    finally:
        raw.close()
    # and grpcio's own client, both ways
    client = grpcclient.InferenceServerClient(server.grpc_url)
    tensor = grpcclient.InferInput("INPUT0", list(values.shape), "FP32")
    tensor.set_data_from_numpy(values)
    np.testing.assert_array_equal(client.infer("identity_fp32", [tensor]).as_numpy("OUTPUT0"), values)


def test_requests_a_little_larger_than_a_stream_window_are_answered(server: QuiverServer) -> None:
    """tritonclient's requests of 64-80 KiB (the message just past HTTP/2's 64 KiB stream
    window, what it lacks less than a quarter window): each gets all the credit it needs and is
    answered well before its deadline, on one connection and one after another."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    for count in (16_380, 16_384, 17_500, 20_000):
        values = np.arange(count, dtype=np.float32)
        tensor = grpcclient.InferInput("INPUT0", [count], "FP32")
        tensor.set_data_from_numpy(values)
        result = client.infer("identity_fp32", [tensor], client_timeout=10)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), values)


def test_a_client_reset_cancels_the_call_and_the_connection_goes_on(server: QuiverServer, raw: RawGrpc) -> None:
    stream_id = raw.start("ModelInfer")
    raw.send(stream_id, framed(count_request("sender_plain", "wait_cancel")))
    time.sleep(0.5)  # the model waits in execute
    raw.conn.reset_stream(stream_id)
    raw.flush()
    assert remembered(server) == b"cancelled"
    live = raw.call("ServerLive", b"")
    assert live.status == 0 and pb.ServerLiveResponse.FromString(live.messages()[0]).live


def test_a_client_that_goes_away_cancels_its_calls(server: QuiverServer) -> None:
    raw = RawGrpc(server.grpc_port)
    stream_id = raw.start("ModelInfer")
    raw.send(stream_id, framed(count_request("sender_plain", "wait_cancel")))
    time.sleep(0.5)
    raw.close()
    assert remembered(server) == b"cancelled"


def test_a_deadline_expires_on_the_server(server: QuiverServer, raw: RawGrpc) -> None:
    """grpc-timeout 300m and a client that does not enforce it: the server ends the call with
    DEADLINE_EXCEEDED itself, and the model sees the request cancelled."""
    started = time.monotonic()
    stream_id = raw.start("ModelInfer", [("grpc-timeout", "300m")])
    raw.send(stream_id, framed(count_request("sender_plain", "wait_cancel")))
    reply = raw.wait(stream_id)
    assert (reply.status, reply.message) == (grpc.StatusCode.DEADLINE_EXCEEDED.value[0], "Deadline Exceeded")
    assert time.monotonic() - started < 10
    assert remembered(server) == b"cancelled"
    client = grpcclient.InferenceServerClient(server.grpc_url)
    count = grpcclient.InferInput("COUNT", [1], "INT32")
    count.set_data_from_numpy(np.array([0], dtype=np.int32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("sender_plain", [count], parameters={"mode": "wait_cancel"}, client_timeout=0.3)
    assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"


def test_bin_metadata_arrives_decoded(server: QuiverServer, raw: RawGrpc) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    tensor = grpcclient.InferInput("INPUT0", [1], "INT32")
    tensor.set_data_from_numpy(np.array([1], dtype=np.int32))
    result = client.infer("echo", [tensor], headers={"x-app-blob-bin": b"\x00\xff\x10", "x-app-user": "ann"})
    parameters = json.loads(result.as_numpy("PARAMETERS")[0])
    assert parameters["x-app-blob-bin"] == "\x00\xff\x10"
    assert parameters["x-app-user"] == "ann"
    request = pb.ModelInferRequest(model_name="echo")
    request.inputs.add(name="INPUT0", datatype="INT32", shape=[1])
    request.raw_input_contents.append(np.array([1], dtype=np.int32).tobytes())
    unpadded = base64.b64encode(b"\x01\x02").rstrip(b"=").decode()  # as gRPC sends it
    reply = raw.call("ModelInfer", request.SerializeToString(), [("x-app-raw-bin", unpadded)])
    response = pb.ModelInferResponse.FromString(reply.messages()[0])
    assert json.loads(response.raw_output_contents[0][4:])["x-app-raw-bin"] == "\x01\x02"
    bad = raw.call("ModelInfer", request.SerializeToString(), [("x-app-raw-bin", "not base64!")])
    assert bad.status == grpc.StatusCode.INTERNAL.value[0] and "x-app-raw-bin" in bad.message


def _goaway_code(data: bytes) -> int | None:
    at = 0
    while len(data) - at >= 9:
        length, kind = int.from_bytes(data[at : at + 3], "big"), data[at + 3]
        if kind == 0x7:
            return int.from_bytes(data[at + 13 : at + 17], "big")
        at += 9 + length
    return None


def _until_closed(sock: socket.socket) -> bytes:
    got = bytearray()
    while chunk := sock.recv(1 << 16):
        got += chunk
    return bytes(got)


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00" + b"\x00\x00\x03\x08\x00\x00\x00\x00\x00abc",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00" + b"\x00\x00\x04\x01\x05\x00\x00\x00\x01\xff\xff\xff\xff",
    ],
    ids=["not-http2", "bad-window-update", "bad-header-block"],
)
def test_bad_bytes_get_goaway_and_other_connections_go_on(server: QuiverServer, garbage: bytes) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    assert client.is_server_live()
    with socket.create_connection(("127.0.0.1", server.grpc_port), timeout=30) as sock:
        sock.sendall(garbage)
        answer = _until_closed(sock)  # the server closes the connection
    assert _goaway_code(answer) in (0x1, 0x6, 0x9)  # PROTOCOL_ERROR, FRAME_SIZE_ERROR, COMPRESSION_ERROR
    assert client.is_server_live() and client.is_model_ready("simple")


def test_a_message_past_the_limit_is_resource_exhausted(server: QuiverServer, raw: RawGrpc) -> None:
    """Refused as soon as its length prefix is read, with grpcio's words; the client keeps
    the connection."""
    stream_id = raw.start("ModelInfer")
    raw.send(stream_id, b"\x00" + (2 * LIMIT).to_bytes(4, "big") + bytes(1000), end=False)
    reply = raw.wait(stream_id)
    assert reply.status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert reply.message == f"Received message larger than max ({2 * LIMIT} vs. {LIMIT})"
    assert raw.call("ServerLive", b"").status == 0
    client = grpcclient.InferenceServerClient(server.grpc_url)
    tensor = grpcclient.InferInput("INPUT0", [LIMIT // 4 + 10], "FP32")
    tensor.set_data_from_numpy(np.zeros(LIMIT // 4 + 10, dtype=np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("identity_fp32", [tensor])
    assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_requests_and_gzip_answers(server: QuiverServer, raw: RawGrpc, encoding: str) -> None:
    values = np.zeros(20_000, dtype=np.float32)  # compresses well
    request = identity_request(values).SerializeToString()
    reply = raw.call("ModelInfer", request, [("grpc-encoding", encoding)], compress=encoding)
    assert reply.status == 0
    assert reply.headers[b"grpc-encoding"] == b"gzip"  # --grpc-infer-response-compression-level high
    assert reply.body[0] == 1 and len(reply.body) < len(request) // 10
    response = pb.ModelInferResponse.FromString(reply.messages()[0])
    np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], dtype=np.float32), values)
    tiny = raw.call("ModelInfer", identity_request(np.ones(2, dtype=np.float32)).SerializeToString())
    assert tiny.status == 0 and tiny.body[0] == 0  # gzip would make it longer: sent as it is
    metadata = raw.call("ServerMetadata", b"")  # as Triton: only inference answers are compressed
    assert b"grpc-encoding" not in metadata.headers and metadata.body[0] == 0
    client = grpcclient.InferenceServerClient(server.grpc_url)
    tensor = grpcclient.InferInput("INPUT0", list(values.shape), "FP32")
    tensor.set_data_from_numpy(values)
    result = client.infer("identity_fp32", [tensor], compression_algorithm=encoding)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), values)
    plain = raw.call("ModelInfer", b"\x1f\x8b not a request", [("grpc-encoding", "gzip")])  # flag 0: as it is
    assert plain.status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "malformed ModelInferRequest" in plain.message
    flagged = raw.start("ModelInfer", [("grpc-encoding", "gzip")])
    raw.send(flagged, b"\x01" + (5).to_bytes(4, "big") + b"junk!")
    assert raw.wait(flagged).status == grpc.StatusCode.INTERNAL.value[0]


def test_an_unknown_encoding_method_or_content_type_is_refused(raw: RawGrpc) -> None:
    unknown = raw.call("/nothing.Here/Method", b"")
    assert (unknown.status, unknown.message) == (grpc.StatusCode.UNIMPLEMENTED.value[0], "Method not found!")
    assert not unknown.trailers  # trailers only
    encoding = raw.call("ServerLive", b"", [("grpc-encoding", "snappy")])
    assert encoding.status == grpc.StatusCode.UNIMPLEMENTED.value[0] and "snappy" in encoding.message
    stream_id = raw.conn.get_next_available_stream_id()
    raw.conn.send_headers(stream_id, [(":method", "POST"), (":scheme", "http"), (":path", "/inference.GRPCInferenceService/ServerLive"),
                                      (":authority", "x"), ("content-type", "text/plain")], end_stream=True)
    raw.replies[stream_id] = type(unknown)()
    raw.flush()
    assert raw.wait(stream_id).headers[b":status"] == b"415"


def test_error_messages_are_percent_encoded_and_read_back_exactly(server: QuiverServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("mødel 100%\u2713")
    assert info.value.status() == "StatusCode.NOT_FOUND"
    assert "'mødel 100%\u2713'" in info.value.message()


def test_health_check_and_watch(server: QuiverServer) -> None:
    with grpc.insecure_channel(server.grpc_url) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            health.Check(health_pb2.HealthCheckRequest(service="nothing.Here"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        watch = health.Watch(health_pb2.HealthCheckRequest(service="inference.GRPCInferenceService"))
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        unknown = health.Watch(health_pb2.HealthCheckRequest(service="nothing.Here"))
        assert next(unknown).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        unknown.cancel()
        with pytest.raises(grpc.RpcError) as malformed:
            channel.unary_unary("/grpc.health.v1.Health/Check")(b"\xff\xff", timeout=10)
        assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _read_frames(sock: socket.socket, buffer: bytearray) -> list[tuple[int, int, bytes]]:
    """(type, flags, payload) of the whole frames received so far."""
    buffer += sock.recv(1 << 16) or b""
    found = []
    while len(buffer) >= 9 and len(buffer) >= 9 + (length := int.from_bytes(buffer[:3], "big")):
        found.append((buffer[3], buffer[4], bytes(buffer[9 : 9 + length])))
        del buffer[: 9 + length]
    return found


def test_keepalive_pings_and_the_connection_age(repository: Path) -> None:
    """--grpc-keepalive-time: the server pings an idle connection; --grpc-max-connection-age:
    it sends GOAWAY (NO_ERROR) once the connection is that old. Frames read raw: h2 takes
    the first of gRPC's two GOAWAYs as the end and refuses the PING that follows it."""
    args = ("--grpc-server", "quiver", "--grpc-keepalive-time=300", "--grpc-keepalive-permit-without-calls=true",
            "--grpc-max-connection-age=1500")
    with QuiverServer(repository, args=args) as running:
        with socket.create_connection(("127.0.0.1", running.grpc_port), timeout=20) as sock:
            sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes((0, 0, 0, 4, 0, 0, 0, 0, 0)))
            buffer, kinds, goaway = bytearray(), [], b""
            deadline = time.monotonic() + 20
            while not goaway and time.monotonic() < deadline:
                for kind, flags, payload in _read_frames(sock, buffer):
                    kinds.append((kind, flags))
                    if kind == 0x6 and not flags & 1:  # a PING: answered
                        sock.sendall(bytes((0, 0, 8, 6, 1, 0, 0, 0, 0)) + payload)
                    elif kind == 0x7:
                        goaway = payload
            assert (0x6, 0) in kinds
            assert goaway and int.from_bytes(goaway[4:8], "big") == 0
        client = grpcclient.InferenceServerClient(running.grpc_url)
        assert client.is_server_live()  # a new connection


def test_mutual_tls_with_alpn_h2(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    repo.mkdir()
    write_onnx(repo, "simple", simple_onnx(), SIMPLE_CONFIG)
    files = certificates(tmp_path)
    args = ("--grpc-server", "quiver", "--grpc-use-ssl-mutual=true", f"--grpc-server-cert={files['server.crt']}",
            f"--grpc-server-key={files['server.key']}", f"--grpc-root-cert={files['ca.crt']}")
    with QuiverServer(repo, args=args) as running:
        url = f"localhost:{running.grpc_port}"
        trusted = grpcclient.InferenceServerClient(
            url, ssl=True, root_certificates=str(files["ca.crt"]), private_key=str(files["client.key"]),
            certificate_chain=str(files["client.crt"]),
        )
        assert trusted.is_model_ready("simple")
        anonymous = grpcclient.InferenceServerClient(url, ssl=True, root_certificates=str(files["ca.crt"]))
        with pytest.raises(InferenceServerException):
            anonymous.is_server_live(client_timeout=5)
        context = ssl.create_default_context(cafile=str(files["ca.crt"]))
        context.load_cert_chain(files["client.crt"], files["client.key"])
        context.set_alpn_protocols(["h2", "http/1.1"])
        with socket.create_connection(("127.0.0.1", running.grpc_port), timeout=30) as sock, \
                context.wrap_socket(sock, server_hostname="localhost") as tls:
            assert tls.selected_alpn_protocol() == "h2"


def test_the_grpcio_server_is_still_there(repository: Path) -> None:
    """--grpc-server grpcio keeps grpc.aio's server for one release: the same answers."""
    with QuiverServer(repository, args=("--grpc-server", "grpcio")) as running:
        client = grpcclient.InferenceServerClient(running.grpc_url)
        values = np.arange(16, dtype=np.float32)
        tensor = grpcclient.InferInput("INPUT0", [16], "FP32")
        tensor.set_data_from_numpy(values)
        np.testing.assert_array_equal(client.infer("identity_fp32", [tensor]).as_numpy("OUTPUT0"), values)
        with grpc.insecure_channel(running.grpc_url) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary("/nothing.Here/Method")(b"", timeout=10)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_an_ipv6_address(repository: Path) -> None:
    with QuiverServer(repository, args=("--grpc-server", "quiver", "--grpc-address", "::1")) as running:
        assert f"started GRPC service at ::1:{running.grpc_port}" in running.log
        client = grpcclient.InferenceServerClient(f"[::1]:{running.grpc_port}")
        assert client.is_server_live() and client.is_model_ready("simple")
        assert client.get_model_metadata("simple").platform == "onnxruntime_onnx"


def test_a_reset_in_the_middle_of_a_stream_cancels_its_requests(server: QuiverServer, raw: RawGrpc) -> None:
    """ModelStreamInfer: the first response has come, the client resets the stream, the
    decoupled model sees its request cancelled; the connection serves on."""
    stream_id = raw.start("ModelStreamInfer")
    request = pb.ModelInferRequest.FromString(count_request("streamer", "wait_cancel"))
    request.raw_input_contents[0] = np.array([1], dtype=np.int32).tobytes()
    raw.send(stream_id, framed(request.SerializeToString()), end=False)
    reply = raw.replies[stream_id]
    while len(reply.body) < 5 or len(reply.body) < 5 + int.from_bytes(reply.body[1:5], "big"):
        raw.read()
    first = pb.ModelStreamInferResponse.FromString(reply.messages()[0])
    assert not first.error_message and first.infer_response.model_name == "streamer"
    raw.conn.reset_stream(stream_id)
    raw.flush()
    deadline, seen = time.monotonic() + 30, 0
    while time.monotonic() < deadline and not seen:
        check = raw.start("ModelStreamInfer")
        report = pb.ModelInferRequest.FromString(count_request("streamer", "report"))
        raw.send(check, framed(report.SerializeToString()))
        answers = [pb.ModelStreamInferResponse.FromString(m) for m in raw.wait(check).messages()]
        seen = int(np.frombuffer(answers[0].infer_response.raw_output_contents[0], dtype=np.int32)[0])
        time.sleep(0.05)
    assert seen == 1, "the model never saw is_cancelled() after the client reset the stream"


def test_a_stop_lets_an_answer_on_its_way_finish(repository: Path) -> None:
    """SIGTERM while a 1 MB answer waits for its client's window: the client gets GOAWAY, then,
    once it opens its window, the whole answer and its trailers; then the server exits."""
    import signal

    with QuiverServer(repository, args=("--grpc-server", "quiver")) as running:
        values = np.arange(250_000, dtype=np.float32)
        raw = RawGrpc(running.grpc_port, auto_ack=False)
        try:
            stream_id = raw.start("ModelInfer")
            raw.send(stream_id, framed(identity_request(values).SerializeToString()))
            reply = raw.replies[stream_id]
            while len(reply.body) < 65535:
                raw.read()
            assert running.process is not None
            running.process.send_signal(signal.SIGTERM)
            time.sleep(1.0)  # the server is stopping; the answer waits for the window
            # From here on frames are read raw: h2 takes the first of the two GOAWAYs as the end.
            raw.sock.sendall(hf.WindowUpdateFrame(0, 4 << 20).serialize() + hf.WindowUpdateFrame(stream_id, 4 << 20).serialize())
            body, buffer, trailers, goaway = bytearray(reply.body), bytearray(), None, False
            while trailers is None and (chunk := raw.sock.recv(1 << 16)):
                buffer += chunk
                while len(buffer) >= 9 and len(buffer) >= 9 + (length := int.from_bytes(buffer[:3], "big")):
                    kind, flags, sid = buffer[3], buffer[4], int.from_bytes(buffer[5:9], "big")
                    payload = bytes(buffer[9 : 9 + length])
                    del buffer[: 9 + length]
                    if kind == 0x0 and sid == stream_id:
                        body += payload
                    elif kind == 0x1 and sid == stream_id:
                        trailers = dict(hpack.Decoder().decode(payload, raw=True))
                    elif kind == 0x6 and not flags & 1:
                        raw.sock.sendall(hf.PingFrame(0, payload, flags=["ACK"]).serialize())
                    elif kind == 0x7:
                        goaway = True
            assert goaway and trailers is not None and trailers[b"grpc-status"] == b"0"
            reply.body = body
            response = pb.ModelInferResponse.FromString(reply.messages()[0])
            np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], dtype=np.float32), values)
        finally:
            raw.close()
        assert running.wait(30) == 0
