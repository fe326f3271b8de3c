"""Large requests are decoded and encoded off the event loop: health checks keep answering
while one is in flight, and the answer is still right."""

from __future__ import annotations

import http.client
import json
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from support.models import write_config
from support.server import QuiverServer

LIMIT = 64 << 20
#: Elements of alternating lengths 0 and 1: the BYTES codec's element loop, not its numpy
#: path for one length. Decoding and encoding them took about 2.5 s on the event loop.
COUNT = 3_000_000
#: What a health check may take meanwhile (it took as long as the decode before).
LIVE_BOUND_S = 0.5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuiverServer]:
    repo = tmp_path_factory.mktemp("large")
    write_config(
        repo,
        "identity_bytes",
        """
        backend: "identity"
        input [ { name: "INPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
        output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
        """,
    )
    args = ("--http-max-input-size", str(LIMIT), "--grpc-max-message-size", str(LIMIT))
    with QuiverServer(repo, args=args) as running:
        yield running


def payload() -> bytes:
    pair = struct.pack("<I", 0) + struct.pack("<I", 1) + b"a"
    return pair * (COUNT // 2)


def live_while(server: QuiverServer, work: Callable[[], bytes]) -> tuple[bytes, list[float], float]:
    """Run ``work`` while polling ``/v2/health/live``; its result, the poll latencies and
    how long the work took."""
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        try:
            while not done.is_set():
                started = time.perf_counter()
                conn.request("GET", "/v2/health/live")
                assert conn.getresponse().read() == b""
                latencies.append(time.perf_counter() - started)
                time.sleep(0.01)
        finally:
            conn.close()

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        time.sleep(0.1)
        started = time.perf_counter()
        result = work()
        duration = time.perf_counter() - started
    finally:
        done.set()
        poller.join()
    return result, latencies, duration


def check_live(latencies: list[float], duration: float) -> None:
    """The health checks were answered while the request ran: none waited for a decode or an
    encode on the event loop, which took most of the request's time before. On a busy machine
    everything slows down together, so the bound grows with the request's own time."""
    assert len(latencies) >= 5, latencies  # the request took a while: polls happened during it
    bound = max(LIVE_BOUND_S, duration / 4)
    assert max(latencies) < bound, f"slowest /v2/health/live: {max(latencies):.2f} s of {duration:.2f} s"


def test_http_binary_bytes(server: QuiverServer) -> None:
    data = payload()
    header = json.dumps(
        {
            "inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [COUNT], "parameters": {"binary_data_size": len(data)}}],
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
        }
    ).encode()

    def work() -> bytes:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        try:
            conn.request(
                "POST",
                "/v2/models/identity_bytes/infer",
                body=header + data,
                headers={"Inference-Header-Content-Length": str(len(header))},
            )
            response = conn.getresponse()
            body = response.read()
            assert response.status == 200, body[:300]
            length = int(response.getheader("Inference-Header-Content-Length") or 0)
            return body[length:]
        finally:
            conn.close()

    answer, latencies, duration = live_while(server, work)
    assert answer == data
    check_live(latencies, duration)


def test_grpc_raw_bytes(server: QuiverServer) -> None:
    data = payload()
    request = service_pb2.ModelInferRequest(model_name="identity_bytes")
    request.inputs.add(name="INPUT0", datatype="BYTES", shape=[COUNT])
    request.raw_input_contents.append(data)
    options = [("grpc.max_send_message_length", LIMIT), ("grpc.max_receive_message_length", LIMIT)]

    def work() -> bytes:
        with grpc.insecure_channel(server.grpc_url, options=options) as channel:
            response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=120)
        assert list(response.outputs[0].shape) == [COUNT]
        answer: bytes = response.raw_output_contents[0]
        return answer

    answer, latencies, duration = live_while(server, work)
    assert answer == data
    check_live(latencies, duration)


def test_http_json_strings(server: QuiverServer) -> None:
    words = ["", "a"] * 500_000
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [len(words)], "data": words}]}).encode()

    def work() -> bytes:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        try:
            conn.request("POST", "/v2/models/identity_bytes/infer", body=body)
            response = conn.getresponse()
            answer = response.read()
            assert response.status == 200, answer[:300]
            return answer
        finally:
            conn.close()

    answer, latencies, duration = live_while(server, work)
    assert json.loads(answer)["outputs"][0]["data"] == words
    check_live(latencies, duration)


def test_small_requests_still_answer_inline(server: QuiverServer, tmp_path: Path) -> None:
    """A small request after the large ones: the same right answer."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [2], "data": ["x", ""]}]})
        conn.request("POST", "/v2/models/identity_bytes/infer", body=body)
        response = conn.getresponse()
        assert response.status == 200
        assert json.loads(response.read())["outputs"][0]["data"] == ["x", ""]
    finally:
        conn.close()
