from __future__ import annotations

import json

import numpy as np
import pytest

from quiver.errors import InvalidArgumentError
from quiver.protocol.bytes_codec import deserialize_bytes, serialize_bytes
from quiver.protocol.v2_json import decode_request, encode_response
from quiver.types import DataType, InferenceResponse, Tensor


def test_bytes_codec_round_trip() -> None:
    data = np.array([b"a", b"", "é".encode(), b"\x00\xff"], dtype=object)
    raw = serialize_bytes(data)
    assert raw[:4] == b"\x01\x00\x00\x00"
    assert list(deserialize_bytes(raw, 4, "x")) == list(data)
    with pytest.raises(InvalidArgumentError, match="left over"):
        deserialize_bytes(raw, 3, "x")
    with pytest.raises(InvalidArgumentError, match="ends after 4 of 5"):
        deserialize_bytes(raw, 5, "x")


def test_decode_json_and_binary_inputs() -> None:
    header = json.dumps(
        {
            "id": "7",
            "inputs": [
                {"name": "A", "datatype": "FP32", "shape": [2, 2], "data": [[1, 2], [3, 4]]},
                {"name": "B", "datatype": "INT16", "shape": [3], "parameters": {"binary_data_size": 6}},
            ],
            "outputs": [{"name": "C", "parameters": {"binary_data": True}}],
            "parameters": {"binary_data_output": False},
        }
    ).encode()
    body = header + np.array([1, -2, 3], dtype="<i2").tobytes()
    request = decode_request(body, len(header), "m", "")
    a, b = request.inputs
    assert a.data.dtype == np.float32 and a.data.shape == (2, 2) and a.data[1, 1] == 4
    assert b.data.tolist() == [1, -2, 3]
    assert request.id == "7"
    assert request.outputs is not None and request.outputs[0].parameters == {"binary_data": True}


def test_encode_mixes_json_and_binary_outputs() -> None:
    request = decode_request(
        json.dumps({"inputs": [], "outputs": [{"name": "X", "parameters": {"binary_data": True}}, {"name": "Y"}]}).encode(),
        None,
        "m",
        "",
    )
    x = np.arange(3, dtype=np.float32)
    y = np.array([b"hi"], dtype=object)
    response = InferenceResponse("m", "1", [Tensor("X", DataType.FP32, (3,), x), Tensor("Y", DataType.BYTES, (1,), y)], "id1")
    body, header_length = encode_response(response, request)
    assert header_length is not None
    header = json.loads(body[:header_length])
    assert header["id"] == "id1"
    assert header["outputs"][0]["parameters"] == {"binary_data_size": 12}
    assert header["outputs"][1]["data"] == ["hi"]
    assert np.frombuffer(body[header_length:], dtype=np.float32).tolist() == [0, 1, 2]


def test_encode_all_json_has_no_header_length() -> None:
    request = decode_request(b'{"inputs": []}', None, "m", "")
    response = InferenceResponse("m", "1", [Tensor("X", DataType.FP16, (2,), np.array([0.5, 1], np.float16))])
    body, header_length = encode_response(response, request)
    assert header_length is None
    assert json.loads(body)["outputs"][0]["data"] == [0.5, 1.0]


@pytest.mark.parametrize(
    ("data", "datatype", "message"),
    [
        ([True, 2], "BOOL", "BOOL data must be true/false"),
        ([1, [2]], "INT32", "ragged"),
        ([1, 2], "BYTES", "BYTES data must be strings"),
        ([-1], "UINT8", "out of range"),
        ([2**64], "UINT64", "UINT64 data must be integers"),  # past u64, JSON gives a float
        (["1.5"], "FP32", "FP32 data must be numbers"),
    ],
)
def test_json_data_is_checked(data: list[object], datatype: str, message: str) -> None:
    body = json.dumps({"inputs": [{"name": "I", "datatype": datatype, "shape": [len(data)], "data": data}]}).encode()
    with pytest.raises(InvalidArgumentError, match=message):
        decode_request(body, None, "m", "")


def test_uint64_above_int64_in_json() -> None:
    body = json.dumps({"inputs": [{"name": "I", "datatype": "UINT64", "shape": [1], "data": [2**64 - 1]}]}).encode()
    assert decode_request(body, None, "m", "").inputs[0].data.tolist() == [2**64 - 1]
