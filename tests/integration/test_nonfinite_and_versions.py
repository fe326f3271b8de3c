"""Non-finite floats in JSON and versions that are not positive integers (issue #20).

Triton's HTTP server writes JSON with rapidjson's ``kWriteNanAndInfFlag`` (``NaN``,
``Infinity``, ``-Infinity``) and reads it with ``kParseNanAndInfFlag``; ``tritonclient.http``
parses with python-rapidjson, which takes those tokens, and writes them for non-finite JSON
inputs. So +inf, -inf and NaN round-trip through JSON instead of coming back as ``null``.

A version in a path or a gRPC field is an integer from 1 to 2^63-1, or empty for the latest:
anything else is INVALID_ARG naming the version and the model, on every route.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from support.server import QuiverServer

SPECIAL = [1.5, np.inf, -np.inf, np.nan, -0.0, 0.25]


@pytest.fixture(scope="module")
def client(server: QuiverServer) -> Iterator[httpclient.InferenceServerClient]:
    with httpclient.InferenceServerClient(server.url) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(server: QuiverServer) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        yield c


def _same(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any]) -> None:
    np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))  # NaN == NaN here
    assert np.array_equal(np.signbit(got.astype(np.float64)), np.signbit(want.astype(np.float64)))


@pytest.mark.parametrize(
    ("datatype", "dtype"),
    [("FP32", np.float32), ("FP64", np.float64), ("FP16", np.float16), ("BF16", ml_dtypes.bfloat16)],
)
def test_nonfinite_floats_round_trip_through_json_output(
    client: httpclient.InferenceServerClient, datatype: str, dtype: Any
) -> None:
    data = np.array(SPECIAL, dtype=dtype)
    inp = httpclient.InferInput("INPUT0", [len(SPECIAL)], datatype)
    inp.set_data_from_numpy(data, binary_data=True)
    wanted = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)]
    result = client.infer(f"identity_{datatype.lower()}", [inp], outputs=wanted)
    assert "null" not in json.dumps(result.get_output("OUTPUT0")["data"], allow_nan=True)
    got = result.as_numpy("OUTPUT0")
    assert got is not None
    _same(got, data)


@pytest.mark.parametrize(("datatype", "dtype"), [("FP32", np.float32), ("FP64", np.float64), ("FP16", np.float16)])
def test_nonfinite_floats_round_trip_through_json_input(
    client: httpclient.InferenceServerClient, datatype: str, dtype: Any
) -> None:
    """tritonclient writes NaN/Infinity/-Infinity in JSON inputs, as Triton reads them."""
    data = np.array(SPECIAL, dtype=dtype)
    inp = httpclient.InferInput("INPUT0", [len(SPECIAL)], datatype)
    inp.set_data_from_numpy(data, binary_data=False)
    wanted = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)]
    got = client.infer(f"identity_{datatype.lower()}", [inp], outputs=wanted).as_numpy("OUTPUT0")
    assert got is not None
    _same(got, data)


def test_finite_json_output_is_unchanged(client: httpclient.InferenceServerClient) -> None:
    data = np.linspace(-3, 3, 200, dtype=np.float32)
    inp = httpclient.InferInput("INPUT0", [200], "FP32")
    inp.set_data_from_numpy(data, binary_data=False)
    result = client.infer("identity_fp32", [inp], outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)])
    got = result.as_numpy("OUTPUT0")
    assert got is not None
    np.testing.assert_array_equal(got, data)


# -- versions --------------------------------------------------------------------------------

BAD_VERSIONS = ["-1", "0", "00", "abc", "1.5", "+1", "99999999999999999999", "9223372036854775808", "1\x00"]


def _get(server: QuiverServer, method: str, path: str, body: bytes | None = None) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    return response.status, json.loads(raw).get("error", "") if raw else ""


def _simple_body() -> bytes:
    tensor = {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))}
    return json.dumps({"inputs": [tensor, dict(tensor, name="INPUT1")]}).encode()


@pytest.mark.parametrize("version", BAD_VERSIONS)
def test_a_version_that_is_not_a_positive_integer_is_a_400_on_every_route(server: QuiverServer, version: str) -> None:
    base = f"/v2/models/simple/versions/{quote(version)}"
    for method, path, body in (
        ("POST", base + "/infer", _simple_body()),
        ("GET", base + "/ready", None),
        ("GET", base + "/config", None),
        ("GET", base + "/stats", None),
        ("GET", base, None),
    ):
        status, error = _get(server, method, path, body)
        assert status == 400, (path, status, error)
        assert "model 'simple'" in error and "version '" in error, error
        assert "integer from 1 to" in error


def test_good_versions_still_work(server: QuiverServer, client: httpclient.InferenceServerClient) -> None:
    assert _get(server, "GET", "/v2/models/versioned/versions/2/ready")[0] == 200
    assert _get(server, "GET", "/v2/models/versioned/versions/02/ready")[0] == 200  # as Triton's stol
    status, error = _get(server, "GET", "/v2/models/versioned/versions/1/ready")
    assert status == 404 and "version 1 is not served" in error
    status, error = _get(server, "POST", "/v2/models/simple/versions/7/infer", _simple_body())
    assert status == 404 and "version 7 is not served" in error
    stats = client.get_inference_statistics("versioned", "3")["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("versioned", "3")]


def test_tritonclient_http_gets_a_400_for_a_negative_version(client: httpclient.InferenceServerClient) -> None:
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for inp in inputs:
        inp.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("simple", inputs, model_version="-1")
    assert info.value.status() == "400" and "version '-1'" in str(info.value.message())
    assert not client.is_model_ready("simple", "0")  # tritonclient's HTTP ready is status == 200


@pytest.mark.parametrize("version", ["-1", "0", "abc", "1.5", "99999999999999999999", "1\x00"])
def test_grpc_versions_are_checked_on_every_method(grpc_client: grpcclient.InferenceServerClient, version: str) -> None:
    inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for inp in inputs:
        inp.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
    calls = [
        lambda: grpc_client.infer("simple", inputs, model_version=version),
        lambda: grpc_client.is_model_ready("simple", version),
        lambda: grpc_client.get_model_metadata("simple", version),
        lambda: grpc_client.get_model_config("simple", version),
        lambda: grpc_client.get_inference_statistics("simple", version),
    ]
    for call in calls:
        with pytest.raises(InferenceServerException) as info:
            call()
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value
        assert "model 'simple'" in str(info.value.message())


def test_grpc_stream_reports_a_bad_version_and_goes_on(grpc_client: grpcclient.InferenceServerClient) -> None:
    import queue

    results: queue.Queue[Any] = queue.Queue()
    inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for inp in inputs:
        inp.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
    grpc_client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        grpc_client.async_stream_infer("simple", inputs, model_version="-1", request_id="bad")
        grpc_client.async_stream_infer("simple", inputs, model_version="1", request_id="good")
        first = results.get(timeout=30)
        second = results.get(timeout=30)
    finally:
        grpc_client.stop_stream()
    assert first[1] is not None and "version '-1'" in str(first[1])
    assert second[1] is None and second[0].as_numpy("OUTPUT0") is not None
