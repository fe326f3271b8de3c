"""+inf, -inf and NaN in JSON tensor data, written and read as Triton does (rapidjson's
``kWriteNanAndInfFlag``/``kParseNanAndInfFlag``: ``NaN``, ``Infinity``, ``-Infinity``)."""

from __future__ import annotations

import json
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import rapidjson

from quiver.errors import InvalidArgumentError
from quiver.protocol.v2_json import decode_request, encode_response
from quiver.types import DataType, InferenceRequest, InferenceResponse, Tensor


def _encode(*tensors: Tensor) -> bytes:
    response = InferenceResponse(model_name="m", model_version="1", outputs=list(tensors))
    body, json_length = encode_response(response, InferenceRequest(model_name="m", model_version="", inputs=[]))
    assert json_length is None
    return body


@pytest.mark.parametrize(
    ("datatype", "dtype"),
    [
        (DataType.FP16, np.float16),
        (DataType.FP32, np.float32),
        (DataType.FP64, np.float64),
        (DataType.BF16, ml_dtypes.bfloat16),
    ],
)
def test_nonfinite_values_get_triton_tokens(datatype: DataType, dtype: Any) -> None:
    data = np.array([[np.nan, 1.5], [np.inf, -np.inf]], dtype=dtype)
    body = _encode(Tensor("OUT", datatype, data.shape, data))
    assert b'"data":[NaN,1.5,Infinity,-Infinity]' in body
    for parse in (rapidjson.loads, json.loads):  # tritonclient's parser, and Python's
        got = np.array(parse(body)["outputs"][0]["data"], dtype=np.float64)
        np.testing.assert_array_equal(got, data.astype(np.float64).reshape(-1))


def test_large_and_mixed_outputs() -> None:
    big = np.arange(1000, dtype=np.float32)
    big[[0, 500, 999]] = [np.inf, np.nan, -np.inf]
    finite = np.linspace(0, 1, 100, dtype=np.float64)
    ints = np.array([1, 2], dtype=np.int32)
    words = np.array([b"null", b"NaN"], dtype=object)
    body = _encode(
        Tensor("BIG", DataType.FP32, big.shape, big),
        Tensor("FIN", DataType.FP64, finite.shape, finite),
        Tensor("INT", DataType.INT32, ints.shape, ints),
        Tensor("STR", DataType.BYTES, words.shape, words),
    )
    outputs = rapidjson.loads(body)["outputs"]
    np.testing.assert_array_equal(np.array(outputs[0]["data"], dtype=np.float32), big)
    np.testing.assert_array_equal(np.array(outputs[1]["data"]), finite)
    assert outputs[2]["data"] == [1, 2] and outputs[3]["data"] == ["null", "NaN"]


def test_finite_values_whose_sum_overflows_stay_numbers() -> None:
    data = np.array([1.7e308, 1.7e308], dtype=np.float64)
    body = _encode(Tensor("OUT", DataType.FP64, data.shape, data))
    assert json.loads(body)["outputs"][0]["data"] == [1.7e308, 1.7e308]


def test_requests_with_nonfinite_tokens_are_read() -> None:
    body = rapidjson.dumps(
        {"inputs": [{"name": "A", "datatype": "FP32", "shape": [3], "data": [float("nan"), float("inf"), -float("inf")]}]}
    ).encode()
    assert b"NaN" in body and b"-Infinity" in body  # what tritonclient sends
    data = decode_request(body, None, "m", "").inputs[0].data
    assert np.isnan(data[0]) and data[1] == np.inf and data[2] == -np.inf
    with pytest.raises(InvalidArgumentError, match="malformed JSON"):
        decode_request(b'{"inputs": [NaN', None, "m", "")
    with pytest.raises(InvalidArgumentError, match="INT32 data must be integers"):
        decode_request(b'{"inputs": [{"name": "A", "datatype": "INT32", "shape": [1], "data": [NaN]}]}', None, "m", "")


def test_long_output_with_nonfinite_values_beside_a_long_finite_one() -> None:
    """Outputs longer than the chunk that long JSON data is written in: the one with a NaN is
    written whole with its tokens, the finite one a chunk at a time; both read back exactly."""
    finite = np.arange(70_000, dtype=np.float32)
    odd = np.arange(70_000, dtype=np.float32)
    odd[[0, 65_536, 69_999]] = [np.nan, np.inf, -np.inf]
    body = _encode(
        Tensor("A", DataType.FP32, finite.shape, finite), Tensor("B", DataType.FP32, odd.shape, odd)
    )
    parsed = json.loads(body)
    np.testing.assert_array_equal(np.array(parsed["outputs"][0]["data"], np.float32), finite)
    np.testing.assert_array_equal(np.array(parsed["outputs"][1]["data"], np.float32), odd)
