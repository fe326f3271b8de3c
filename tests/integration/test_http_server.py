"""Quiver's own HTTP/1.1 server (frontends/http_server.py) on the wire: pipelining,
keep-alive, HTTP/1.0, chunked bodies, 100-continue, malformed and oversized requests, clients
that go away. Plain sockets where a client library would hide the protocol, tritonclient
where a real client's behaviour is the point; the shared server of conftest.py throughout."""

from __future__ import annotations

import json
import socket
import time
from typing import Any, BinaryIO

import numpy as np
import tritonclient.http as httpclient
from conftest import MAX_INPUT_SIZE

from support.server import QuiverServer

IDENTITY = "/v2/models/identity_fp32/infer"


def _identity_body(values: list[float]) -> bytes:
    return json.dumps(
        {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [len(values)], "data": values}]}
    ).encode()


def _post(path: str, body: bytes, *extra: str, version: str = "1.1") -> bytes:
    head = [f"POST {path} HTTP/{version}", "Host: x", "Content-Type: application/json", f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _get(path: str, *extra: str, version: str = "1.1") -> bytes:
    return ("\r\n".join([f"GET {path} HTTP/{version}", "Host: x", *extra]) + "\r\n\r\n").encode()


def _connect(server: QuiverServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=30)


def _read_response(stream: BinaryIO) -> tuple[int, dict[str, str], bytes]:
    """One response off ``stream``: status, headers (lower-case names), body (content-length
    or chunked framing undone)."""
    status_line = stream.readline()
    assert status_line.startswith(b"HTTP/1.1 "), status_line
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := stream.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        return status, headers, stream.read(int(headers["content-length"]))
    body = b""
    if headers.get("transfer-encoding") == "chunked":
        while (size := int(stream.readline().strip(), 16)) > 0:
            body += stream.read(size)
            stream.readline()
        stream.readline()
    return status, headers, body


def _closed_by_server(sock: socket.socket, timeout: float = 30.0) -> bool:
    """Whether the server closes the connection (reading past any answer) within ``timeout``."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return True


def _still_serves(server: QuiverServer) -> None:
    with _connect(server) as sock:
        sock.sendall(_get("/v2/health/live"))
        assert _read_response(sock.makefile("rb"))[0] == 200


def test_pipelined_requests_are_answered_in_order_on_one_connection(server: QuiverServer) -> None:
    requests = [
        _post(IDENTITY, _identity_body([1.0, 2.0])),
        _get("/v2/models/simple"),
        _post(IDENTITY, _identity_body([3.0])),
        _post("/v2/models/no_such_model/infer", _identity_body([1.0])),
        _get("/v2/health/live"),
    ]
    with _connect(server) as sock:
        sock.sendall(b"".join(requests))  # all at once: the server must not answer out of order
        stream = sock.makefile("rb")
        answers = [_read_response(stream) for _ in requests]
    assert [status for status, _, _ in answers] == [200, 200, 200, 404, 200]
    assert json.loads(answers[0][2])["outputs"][0]["data"] == [1.0, 2.0]
    assert json.loads(answers[1][2])["name"] == "simple"
    assert json.loads(answers[2][2])["outputs"][0]["data"] == [3.0]
    assert "no_such_model" in json.loads(answers[3][2])["error"]


def test_a_deep_pipeline_is_read_in_turns_and_answered_in_full(server: QuiverServer) -> None:
    # More requests than the server parses ahead (16): it stops reading, then reads on.
    requests = [_post(IDENTITY, _identity_body([float(i)] * 300)) for i in range(60)]
    with _connect(server) as sock:
        sock.sendall(b"".join(requests))
        stream = sock.makefile("rb")
        answers = [_read_response(stream) for _ in requests]
    assert [status for status, _, _ in answers] == [200] * len(requests)
    assert [json.loads(body)["outputs"][0]["data"][0] for _, _, body in answers] == [float(i) for i in range(60)]


def test_keep_alive_serves_many_requests_and_connection_close_ends_it(server: QuiverServer) -> None:
    with _connect(server) as sock:
        stream = sock.makefile("rb")
        for value in range(5):
            sock.sendall(_post(IDENTITY, _identity_body([float(value)])))
            status, headers, body = _read_response(stream)
            assert status == 200 and "connection" not in headers
            assert json.loads(body)["outputs"][0]["data"] == [float(value)]
        sock.sendall(_get("/v2/health/live", "Connection: close"))
        status, headers, _ = _read_response(stream)
        assert status == 200 and headers["connection"] == "close"
        assert _closed_by_server(sock)


def test_http_1_0_is_answered_then_closed(server: QuiverServer) -> None:
    with _connect(server) as sock:
        sock.sendall(_post(IDENTITY, _identity_body([7.0]), version="1.0"))
        status, headers, body = _read_response(sock.makefile("rb"))
        assert status == 200 and headers["connection"] == "close"
        assert json.loads(body)["outputs"][0]["data"] == [7.0]
        assert _closed_by_server(sock)


def test_chunked_request_body_is_reassembled(server: QuiverServer) -> None:
    body = _identity_body([0.5] * 100)
    parts = [body[i : i + 37] for i in range(0, len(body), 37)]
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    head = f"POST {IDENTITY} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    with _connect(server) as sock:
        sock.sendall(head)
        for i in range(0, len(chunked), 100):  # the chunks arrive over several reads
            sock.sendall(chunked[i : i + 100])
            time.sleep(0.001)
        status, _, answer = _read_response(sock.makefile("rb"))
    assert status == 200
    assert json.loads(answer)["outputs"][0]["data"] == [0.5] * 100


def test_chunked_body_past_the_input_size_limit_is_refused(server: QuiverServer) -> None:
    head = f"POST {IDENTITY} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    chunk = b"%x\r\n%s\r\n" % (64 * 1024, b" " * 64 * 1024)
    with _connect(server) as sock:
        sock.sendall(head)
        with_room = MAX_INPUT_SIZE // (64 * 1024) + 2
        try:
            for _ in range(with_room):
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may stop reading once it answered
        status, _, body = _read_response(sock.makefile("rb"))
    assert status == 413
    assert str(MAX_INPUT_SIZE) in json.loads(body)["error"]
    _still_serves(server)


def test_expect_100_continue_gets_the_interim_answer_before_the_body(server: QuiverServer) -> None:
    body = _identity_body([4.0, 5.0])
    with _connect(server) as sock:
        sock.sendall(_post(IDENTITY, b"", "Expect: 100-continue").replace(b"Content-Length: 0", f"Content-Length: {len(body)}".encode()))
        stream = sock.makefile("rb")
        assert stream.readline() == b"HTTP/1.1 100 Continue\r\n"
        assert stream.readline() == b"\r\n"
        sock.sendall(body)
        status, _, answer = _read_response(stream)
    assert status == 200
    assert json.loads(answer)["outputs"][0]["data"] == [4.0, 5.0]


def test_malformed_request_line_is_answered_400_and_closed(server: QuiverServer) -> None:
    for garbage in (b"NOT HTTP AT ALL\r\n\r\n", b"GET /v2 HTTP/9.Z\r\n\r\n", b"\x00\x01\x02\r\n\r\n", b"GET /v2/\xff HTTP/1.1\r\nHost: x\r\n\r\n"):
        with _connect(server) as sock:
            sock.sendall(garbage)
            status, headers, body = _read_response(sock.makefile("rb"))
            assert status == 400, garbage
            assert headers["connection"] == "close"
            assert b"Invalid HTTP request" in body
            assert _closed_by_server(sock)
    _still_serves(server)


def test_an_upgrade_request_is_answered_as_any_other_and_ends_the_connection(server: QuiverServer) -> None:
    # No protocol to upgrade to: what follows the head is not parsed as HTTP any more.
    with _connect(server) as sock:
        sock.sendall(_get("/v2/health/live", "Connection: Upgrade", "Upgrade: websocket") + _get("/v2/health/live"))
        status, headers, _ = _read_response(sock.makefile("rb"))
        assert status == 200 and headers["connection"] == "close"
        assert _closed_by_server(sock)
    _still_serves(server)


def test_oversized_request_head_is_answered_431(server: QuiverServer) -> None:
    with _connect(server) as sock:
        sock.sendall(_get("/v2/health/live", "X-Big: " + "a" * (300 * 1024)))
        status, headers, _ = _read_response(sock.makefile("rb"))
        assert status == 431 and headers["connection"] == "close"
        assert _closed_by_server(sock)
    with _connect(server) as sock:  # many small headers add up the same way
        sock.sendall(_get("/v2/health/live", *(f"X-H{i}: {'b' * 100}" for i in range(4000))))
        assert _read_response(sock.makefile("rb"))[0] == 431
    _still_serves(server)


def test_declared_body_past_the_limit_is_refused_without_reading_it(server: QuiverServer) -> None:
    with _connect(server) as sock:
        sock.sendall(
            f"POST {IDENTITY} HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_INPUT_SIZE * 50}\r\n\r\n".encode()
        )
        status, _, body = _read_response(sock.makefile("rb"))
    assert status == 413
    assert str(MAX_INPUT_SIZE) in json.loads(body)["error"]
    _still_serves(server)


def test_client_that_goes_away_mid_request_leaves_the_server_serving(server: QuiverServer) -> None:
    body = _identity_body([1.0] * 1000)
    for cut in (10, len(body) // 2):
        with _connect(server) as sock:
            sock.sendall(_post(IDENTITY, body)[: -len(body) + cut])
        with _connect(server) as sock:  # head only, then gone
            sock.sendall(_post(IDENTITY, body).split(b"\r\n\r\n")[0])
    # a whole request whose answer nobody reads
    with _connect(server) as sock:
        sock.sendall(_post(IDENTITY, body))
    _still_serves(server)
    client = httpclient.InferenceServerClient(server.url)
    assert client.is_server_live()


def test_idle_keep_alive_connection_is_closed_by_the_server(server: QuiverServer) -> None:
    with _connect(server) as sock:
        sock.sendall(_get("/v2/health/live"))
        assert _read_response(sock.makefile("rb"))[0] == 200
        assert _closed_by_server(sock, timeout=30.0)


def test_a_half_sent_request_head_that_goes_quiet_is_closed(server: QuiverServer) -> None:
    with _connect(server) as sock:
        sock.sendall(b"POST /v2/models/identity_fp32/infer HTTP/1.1\r\nHost: x\r\nContent-Le")
        assert _closed_by_server(sock, timeout=30.0)
    _still_serves(server)


def test_tritonclient_binary_requests_share_connections_concurrently(server: QuiverServer) -> None:
    client = httpclient.InferenceServerClient(server.url, concurrency=4)
    try:
        pending: list[tuple[Any, np.ndarray[Any, Any]]] = []
        for i in range(40):
            data = np.arange(1, 17, dtype=np.int32).reshape(1, 16) * i
            inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
            inputs[0].set_data_from_numpy(data, binary_data=True)
            inputs[1].set_data_from_numpy(np.ones((1, 16), np.int32), binary_data=i % 2 == 0)
            outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=i % 3 != 0)]
            pending.append((client.async_infer("simple", inputs, outputs=outputs), data))
        for future, data in pending:
            np.testing.assert_array_equal(future.get_result().as_numpy("OUTPUT0"), data + 1)
    finally:
        client.close()
