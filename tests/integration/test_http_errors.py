"""Bad input over HTTP: each gets the right status and a message naming what was wrong,
and the server goes on serving everything else."""

from __future__ import annotations

import gzip
import http.client
import json
import struct
from typing import Any

import numpy as np
import pytest
from conftest import MAX_INPUT_SIZE

from support.server import QuiverServer


def request(
    server: QuiverServer,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any] | None, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    payload = json.loads(raw) if raw and response.getheader("content-type", "").startswith("application/json") else None
    return response.status, payload, response


def infer(server: QuiverServer, model: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, str]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, payload, _ = request(server, "POST", f"/v2/models/{model}/infer", raw, headers)
    return status, (payload or {}).get("error", "")


def simple_body(**overrides: Any) -> dict[str, Any]:
    tensor = {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))}
    body = {"inputs": [tensor, dict(tensor, name="INPUT1")]}
    body.update(overrides)
    return body


@pytest.fixture(autouse=True)
def still_serving(server: QuiverServer):  # type: ignore[no-untyped-def]
    """After every bad request, a good one still works."""
    yield
    status, payload, _ = request(server, "POST", "/v2/models/simple/infer", json.dumps(simple_body()).encode())
    assert status == 200, payload
    assert payload is not None and payload["outputs"][0]["data"][:3] == [0, 2, 4]


CASES = [
    ("malformed json", b'{"inputs": [', 400, "malformed JSON"),
    ("not an object", b"[1, 2]", 400, "JSON object"),
    ("no inputs", {"outputs": []}, 400, "'inputs'"),
    ("unknown datatype", simple_body(inputs=[{"name": "INPUT0", "datatype": "FP8", "shape": [1], "data": [1]}]), 400, "unknown datatype 'FP8'"),
    ("wrong datatype", simple_body(inputs=[{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}, {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}]), 400, "inference input 'INPUT0' data-type is 'FP32', but model 'simple' expects 'INT32'"),
    ("shape does not match data", simple_body(inputs=[{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [1, 2, 3]}]), 400, "needs 16 elements but 'data' has 3"),
    ("shape does not match config", simple_body(inputs=[{"name": "INPUT0", "datatype": "INT32", "shape": [1, 8], "data": [1] * 8}, {"name": "INPUT1", "datatype": "INT32", "shape": [1, 8], "data": [1] * 8}]), 400, "unexpected shape for input 'INPUT0' for model 'simple'"),
    ("batch too large", simple_body(inputs=[{"name": n, "datatype": "INT32", "shape": [9, 16], "data": [1] * 144} for n in ("INPUT0", "INPUT1")]), 400, "batch-size must be <= 8"),
    ("missing input", simple_body(inputs=[{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}]), 400, "expected 2 inputs but got 1 inputs for model 'simple'. Got input(s) ['INPUT0'], but missing required input(s) ['INPUT1']"),
    ("unknown input", simple_body(inputs=[*simple_body()["inputs"], {"name": "INPUT9", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}]), 400, "unexpected inference input 'INPUT9'"),
    ("unknown output", simple_body(outputs=[{"name": "OUTPUT7"}]), 400, "unexpected inference output 'OUTPUT7'"),
    ("string in numbers", simple_body(inputs=[{"name": "INPUT0", "datatype": "INT32", "shape": [1, 2], "data": ["a", "b"]}]), 400, "INT32 data must be integers"),
    ("float for int", simple_body(inputs=[{"name": "INPUT0", "datatype": "INT32", "shape": [1, 2], "data": [1.5, 2]}]), 400, "INT32 data must be integers"),
    ("out of range", simple_body(inputs=[{"name": "INPUT0", "datatype": "INT32", "shape": [1, 1], "data": [2**40]}]), 400, "out of range for INT32"),
    ("negative dim", simple_body(inputs=[{"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16], "data": [1] * 16}]), 400, "'shape' must be a list of non-negative integers"),
    ("bad classification", simple_body(outputs=[{"name": "OUTPUT0", "parameters": {"classification": "x"}}]), 400, "'classification' must be a non-negative integer"),
]


@pytest.mark.parametrize(("body", "status", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_bodies(server: QuiverServer, body: Any, status: int, message: str) -> None:
    got_status, error = infer(server, "simple", body)
    assert got_status == status, error
    assert message in error


def binary_body(declared_size: int, actual: bytes) -> tuple[bytes, dict[str, str]]:
    header = json.dumps(
        {
            "inputs": [
                {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "parameters": {"binary_data_size": declared_size}},
                {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))},
            ]
        }
    ).encode()
    return header + actual, {"Inference-Header-Content-Length": str(len(header))}


def test_binary_header_length_that_lies(server: QuiverServer) -> None:
    body, headers = binary_body(64, np.zeros(16, np.int32).tobytes())
    status, error = infer(server, "simple", body, {"Inference-Header-Content-Length": str(len(body) + 10)})
    assert status == 400 and "Inference-Header-Content-Length is" in error
    status, error = infer(server, "simple", body, {"Inference-Header-Content-Length": "ten"})
    assert status == 400 and "must be an integer" in error
    status, error = infer(server, "simple", body, {"Inference-Header-Content-Length": str(int(headers["Inference-Header-Content-Length"]) - 5)})
    assert status == 400


def test_binary_size_that_does_not_match_shape(server: QuiverServer) -> None:
    body, headers = binary_body(60, np.zeros(15, np.int32).tobytes())
    status, error = infer(server, "simple", body, headers)
    assert status == 400 and "needs 64 bytes but binary_data_size is 60" in error


def test_binary_data_past_the_end_and_left_over(server: QuiverServer) -> None:
    body, headers = binary_body(64, np.zeros(8, np.int32).tobytes())
    status, error = infer(server, "simple", body, headers)
    assert status == 400 and "runs past the end of the body" in error
    body, headers = binary_body(64, np.zeros(20, np.int32).tobytes())
    status, error = infer(server, "simple", body, headers)
    assert status == 400 and "bytes after the last binary input" in error


def test_bytes_tensor_with_lying_element_length(server: QuiverServer) -> None:
    payload = struct.pack("<I", 100) + b"short"
    header = json.dumps(
        {"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": len(payload)}}]}
    ).encode()
    status, error = infer(server, "identity_bytes", header + payload, {"Inference-Header-Content-Length": str(len(header))})
    assert status == 400 and "claims 100 bytes" in error


def test_unknown_model_and_version(server: QuiverServer) -> None:
    status, error = infer(server, "no_such_model", simple_body())
    assert status == 404 and "unknown model: 'no_such_model'" in error
    status, payload, _ = request(server, "GET", "/v2/models/no_such_model")
    assert status == 404
    status, payload, _ = request(server, "POST", "/v2/models/simple/versions/7/infer", json.dumps(simple_body()).encode())
    assert status == 404 and payload is not None and "version 7 is not served" in payload["error"]
    status, payload, _ = request(server, "POST", "/v2/models/simple/versions/latest/infer", json.dumps(simple_body()).encode())
    assert status == 400 and payload is not None and "is not a number" in payload["error"]
    status, _, _ = request(server, "GET", "/v2/models/no_such_model/ready")
    assert status == 404


def test_unknown_route_and_method(server: QuiverServer) -> None:
    status, payload, _ = request(server, "GET", "/v3/nothing")
    assert status == 404 and payload is not None and "no route" in payload["error"]
    status, payload, _ = request(server, "GET", "/v2/models/simple/infer")
    assert status == 405


def test_body_over_the_size_limit(server: QuiverServer) -> None:
    big = b"x" * (MAX_INPUT_SIZE + 1)
    status, error = infer(server, "simple", big)
    assert status == 413 and "--http-max-input-size" in error


def test_compressed_body_that_inflates_past_the_limit(server: QuiverServer) -> None:
    bomb = gzip.compress(b"0" * (MAX_INPUT_SIZE * 4))
    assert len(bomb) < MAX_INPUT_SIZE // 10
    status, _error = infer(server, "simple", bomb, {"Content-Encoding": "gzip"})
    assert status == 413


def test_corrupt_and_unknown_content_encoding(server: QuiverServer) -> None:
    status, error = infer(server, "simple", b"not gzip at all", {"Content-Encoding": "gzip"})
    assert status == 400 and "not valid gzip" in error
    status, error = infer(server, "simple", json.dumps(simple_body()).encode(), {"Content-Encoding": "br"})
    assert status == 400 and "unsupported Content-Encoding 'br'" in error


def test_a_repeated_input_is_a_client_error(server: QuiverServer) -> None:
    tensor = {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))}
    status, error = infer(server, "simple", {"inputs": [tensor, tensor]})
    assert status == 400 and error == "input 'INPUT0' already exists in request"  # Triton's text


def test_empty_outputs_list_means_every_output(server: QuiverServer) -> None:
    status, payload, _ = request(server, "POST", "/v2/models/simple/infer", json.dumps(simple_body(outputs=[])).encode())
    assert status == 200 and payload is not None
    assert [o["name"] for o in payload["outputs"]] == ["OUTPUT0", "OUTPUT1"]


def test_bytes_count_larger_than_the_data_is_refused_before_allocating(server: QuiverServer) -> None:
    header = json.dumps(
        {"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [2**40], "parameters": {"binary_data_size": 0}}]}
    ).encode()
    status, error = infer(server, "identity_bytes", header, {"Inference-Header-Content-Length": str(len(header))})
    assert status == 400 and "need at least" in error


def test_chunked_body_over_the_limit_on_the_repository_api(server: QuiverServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.putrequest("POST", "/v2/repository/index")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        chunk = b"x" * 65536
        sent = 0
        try:
            while sent <= MAX_INPUT_SIZE * 2:
                conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
            conn.send(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before the whole body went out
        response = conn.getresponse()
        assert response.status == 413
    finally:
        conn.close()


# -- limits: shapes past what an array can be, JSON nested past Triton's 100 levels ---------

HUGE = 1 << 62


def deep(depth: int, leaf: str = '"x"', kind: str = "list") -> str:
    """JSON text nested ``depth`` deep (json.dumps itself would recurse past ~1000)."""
    if kind == "list":
        return "[" * depth + leaf + "]" * depth
    return '{"k":' * depth + leaf + "}" * depth


def with_text(value: dict[str, Any], text: str) -> bytes:
    """``value`` as JSON with the string "MARK" replaced by raw JSON ``text``."""
    return json.dumps(value).replace('"MARK"', text).encode()


def binary(header: dict[str, Any], data: bytes = b"") -> tuple[bytes, dict[str, str]]:
    raw = json.dumps(header).encode()
    return raw + data, {"Inference-Header-Content-Length": str(len(raw))}


def one_input(datatype: str, shape: Any, data: Any = "MARK", **extra: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "INPUT0", "datatype": datatype, "shape": shape, "data": data}], **extra}


LIMIT_CASES: list[tuple[str, str, bytes, dict[str, str], str]] = [
    ("zero and huge dims", "identity_int32", json.dumps(one_input("INT32", [0, HUGE], [])).encode(), {},
     f"input 'INPUT0': shape [0, {HUGE}] is too large"),
    ("huge and zero dims", "simple", json.dumps(simple_body(inputs=[one_input("INT32", [HUGE, 0], [])["inputs"][0] | {"name": n} for n in ("INPUT0", "INPUT1")])).encode(), {},
     "input 'INPUT0': shape"),
    ("rank 65", "identity_int32", json.dumps(one_input("INT32", [1] * 65, [1])).encode(), {},
     "input 'INPUT0': 'shape' has 65 dimensions, more than the 64 allowed"),
    ("rank 65 of zeros", "identity_int32", json.dumps(one_input("INT32", [0] * 65, [])).encode(), {}, "has 65 dimensions"),
    ("dim past int64", "identity_int32", json.dumps(one_input("INT32", [1 << 63], [])).encode(), {}, "non-negative integers (int64)"),
    ("BYTES data 1000 deep", "identity_bytes", with_text(one_input("BYTES", [1]), deep(1000)), {},
     "input 'INPUT0': 'data': JSON nesting depth exceeds maximum allowed limit (100)"),
    ("INT32 data 100 deep", "identity_int32", with_text(one_input("INT32", [1]), deep(100, "1")), {},
     "input 'INPUT0': 'data': JSON nesting depth exceeds maximum allowed limit (100)"),
    ("request parameters 1000 deep", "identity_int32", with_text(one_input("INT32", [1], [1], parameters={"p": "MARK"}), deep(1000, "1", "dict")), {},
     "inference request: 'parameters': JSON nesting depth exceeds"),
    ("input parameters 500 deep", "identity_int32", with_text({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1], "data": [1], "parameters": {"p": "MARK"}}]}, deep(500, "[]")), {},
     "input 'INPUT0': 'parameters': JSON nesting depth exceeds"),
    ("output parameters 500 deep", "identity_int32", with_text(one_input("INT32", [1], [1], outputs=[{"name": "OUTPUT0", "parameters": {"p": "MARK"}}]), deep(500)), {},
     "output 'OUTPUT0': 'parameters': JSON nesting depth exceeds"),
    ("python model parameters 1000 deep", "add_sub", with_text({"inputs": [{"name": n, "datatype": "FP32", "shape": [4], "data": [1, 2, 3, 4]} for n in ("INPUT0", "INPUT1")], "parameters": {"p": "MARK"}}, deep(1000, "1", "dict")), {},
     "inference request: 'parameters': JSON nesting depth exceeds"),
    ("binary zero and huge", "identity_int32", *binary({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [0, HUGE], "parameters": {"binary_data_size": 0}}]}),
     f"input 'INPUT0': shape [0, {HUGE}] is too large"),
    ("binary BYTES zero and huge", "identity_bytes", *binary({"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [0, HUGE], "parameters": {"binary_data_size": 0}}]}),
     "is too large"),
    ("binary BYTES count past the bytes", "identity_bytes", *binary({"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1 << 40], "parameters": {"binary_data_size": 8}}]}, bytes(8)),
     "need at least"),
]


@pytest.mark.parametrize(("model", "body", "headers", "message"), [c[1:] for c in LIMIT_CASES], ids=[c[0] for c in LIMIT_CASES])
def test_limits_are_client_errors(server: QuiverServer, model: str, body: bytes, headers: dict[str, str], message: str) -> None:
    status, error = infer(server, model, body, headers)
    assert status == 400, error
    assert message in error


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v2/repository/index", with_text({"ready": "MARK"}, deep(1000)), "request body: 'ready': JSON nesting depth exceeds"),
        ("/v2/repository/models/simple/load", with_text({"parameters": {"config": "MARK"}}, deep(1000, "1", "dict")), "request body: 'parameters': JSON nesting depth exceeds"),
        ("/v2/repository/models/simple/unload", with_text({"parameters": "MARK"}, deep(200, "{}", "dict")), "request body: 'parameters': JSON nesting depth exceeds"),
        ("/v2/logging", with_text({"log_info": "MARK"}, deep(1000)), "request body: 'log_info': JSON nesting depth exceeds"),
        ("/v2/logging", deep(2000).encode(), "malformed JSON"),  # past orjson's own 1024
    ],
)
def test_deep_bodies_on_the_other_routes(server: QuiverServer, path: str, body: bytes, message: str) -> None:
    status, payload, _ = request(server, "POST", path, body)
    assert status == 400 and payload is not None, payload
    assert message in payload["error"]


def test_tritonclient_after_the_limits(server: QuiverServer) -> None:
    """A client that sent all of the above still gets right answers, JSON and binary."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.url)
    try:
        for model, body, headers, _ in [c[1:] for c in LIMIT_CASES]:
            infer(server, model, body, headers)
        sent = {
            True: np.array([b"a", b"", b"\x00\xc3\xa9"] * 100, dtype=object),  # binary
            False: np.array(["a", "", "\u00e9"] * 100, dtype=object),  # JSON: strings
        }
        for binary_data, words in sent.items():
            inp = httpclient.InferInput("INPUT0", list(words.shape), "BYTES")
            inp.set_data_from_numpy(words, binary_data=binary_data)
            out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
            got = client.infer("identity_bytes", [inp], outputs=[out]).as_numpy("OUTPUT0").tolist()
            assert got == [w if isinstance(w, bytes) else w.encode() for w in words]
    finally:
        client.close()


def test_bytes_that_are_not_utf8_for_an_onnx_string_model(server: QuiverServer) -> None:
    payload = struct.pack("<I", 2) + b"\x00\xff"
    body, headers = binary({"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": len(payload)}}]}, payload)
    status, error = infer(server, "identity_bytes", body, headers)
    assert status == 400, error
    assert "input 'INPUT0': onnxruntime string tensors hold UTF-8 text" in error
