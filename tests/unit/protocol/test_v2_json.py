from __future__ import annotations

import contextlib
import json

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quiver.errors import InvalidArgumentError
from quiver.protocol.bytes_codec import deserialize_bytes, serialize_bytes
from quiver.protocol.v2_json import decode_cost, decode_request, encode_cost, encode_response
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


# -- limits: shapes and nesting depth ------------------------------------------------------

HUGE = 1 << 62


def deep(depth: int, leaf: str = '"x"', kind: str = "list") -> str:
    """JSON text nested ``depth`` deep (json.dumps would recurse)."""
    if kind == "list":
        return "[" * depth + leaf + "]" * depth
    return '{"k":' * depth + leaf + "}" * depth


def body_with(marker: str, text: str, value: dict[str, object]) -> bytes:
    return json.dumps(value).replace(json.dumps(marker), text).encode()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (body_with("D", deep(1000), {"inputs": [{"name": "S", "datatype": "BYTES", "shape": [1], "data": "D"}]}), "input 'S': 'data': JSON nesting depth exceeds maximum allowed limit (100)"),
        (body_with("D", deep(100, "1"), {"inputs": [{"name": "I", "datatype": "INT32", "shape": [1], "data": "D"}]}), "input 'I': 'data': JSON nesting depth exceeds"),
        (body_with("D", deep(1000, "1", "dict"), {"inputs": [], "parameters": {"p": "D"}}), "inference request: 'parameters': JSON nesting depth exceeds"),
        (body_with("D", deep(200, "1", "dict"), {"inputs": [{"name": "I", "datatype": "INT32", "shape": [1], "data": [1], "parameters": "D"}]}), "input 'I': 'parameters': JSON nesting"),
        (body_with("D", deep(200, "1", "dict"), {"inputs": [], "outputs": [{"name": "O", "parameters": "D"}]}), "output 'O': 'parameters': JSON nesting"),
        (body_with("D", deep(300), {"inputs": [], "id": "D"}), "inference request: 'id': JSON nesting"),
        (body_with("D", deep(300), {"inputs": ["D"]}), "inference request: 'inputs': JSON nesting"),
        (json.dumps({"inputs": [{"name": "I", "datatype": "INT32", "shape": [0, HUGE], "data": []}]}).encode(), f"input 'I': shape [0, {HUGE}] is too large"),
        (json.dumps({"inputs": [{"name": "I", "datatype": "INT32", "shape": [1] * 65, "data": [1]}]}).encode(), "input 'I': 'shape' has 65 dimensions, more than the 64 allowed"),
        (json.dumps({"inputs": [{"name": "I", "datatype": "BYTES", "shape": [HUGE, 0], "data": []}]}).encode(), "is too large"),
        (json.dumps({"inputs": [{"name": "I", "datatype": "INT32", "shape": [1 << 63], "data": []}]}).encode(), "non-negative integers (int64)"),
        (json.dumps({"inputs": [{"name": "I", "datatype": "BYTES", "shape": [3], "data": ["a", ["b"]]}]}).encode(), "needs 3 elements but 'data' has 2"),
    ],
    ids=["deep BYTES data", "deep INT32 data", "deep request parameters", "deep input parameters", "deep output parameters", "deep id", "deep input", "zero and huge", "rank 65", "BYTES huge and zero", "past int64", "BYTES count"],
)
def test_limits_are_client_errors_naming_the_field(body: bytes, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        decode_request(body, None, "m", "")
    assert message in info.value.message


def test_limits_over_binary_data() -> None:
    for datatype in ("INT32", "BYTES"):
        header = json.dumps({"inputs": [{"name": "B", "datatype": datatype, "shape": [0, HUGE], "parameters": {"binary_data_size": 0}}]}).encode()
        with pytest.raises(InvalidArgumentError, match=rf"input 'B': shape \[0, {HUGE}\] is too large"):
            decode_request(header, len(header), "m", "")


def test_nesting_up_to_the_limit_is_fine() -> None:
    body = body_with("D", deep(99, '"x"'), {"inputs": [{"name": "S", "datatype": "BYTES", "shape": [1], "data": "D"}]})
    assert decode_request(body, None, "m", "").inputs[0].data.tolist() == [b"x"]
    rows = [[f"{r}{c}" for c in range(3)] for r in range(200)]  # 200 '[': the real walk runs
    body = json.dumps({"inputs": [{"name": "S", "datatype": "BYTES", "shape": [200, 3], "data": rows}]}).encode()
    assert decode_request(body, None, "m", "").inputs[0].data[199, 2] == b"1992"


json_scalars = st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats(allow_nan=False) | st.text(max_size=3)
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=3), c, max_size=3), max_leaves=12)
tensors = st.fixed_dictionaries(
    {
        "name": st.text(max_size=3),
        "datatype": st.sampled_from([d.value for d in DataType] + ["FP8", 3]),
        "shape": st.one_of(
            st.lists(st.integers(-2, 4), max_size=4),
            st.lists(st.sampled_from([0, 2, HUGE, 1 << 63]), min_size=1, max_size=3),
            st.lists(st.just(1), min_size=60, max_size=70),
            json_values,
        ),
        "data": st.one_of(st.just([]), st.lists(st.integers(0, 3), max_size=4), st.lists(st.text(max_size=2), max_size=4), json_values),
    },
    optional={
        "parameters": st.one_of(st.dictionaries(st.sampled_from(["binary_data_size", "x"]), st.integers(-1, 64) | json_values), json_values),
    },
)
request_bodies = st.fixed_dictionaries(
    {"inputs": st.lists(tensors, max_size=3) | json_values},
    optional={"outputs": json_values, "parameters": json_values, "id": json_values},
)


@settings(max_examples=400, deadline=None)
@given(request_bodies, st.binary(max_size=64))
def test_any_body_decodes_or_is_a_client_error(header: dict[str, object], tail: bytes) -> None:
    """Hostile headers and binary tails: a request, or InvalidArgumentError, nothing else."""
    raw = orjson.dumps(header)
    for body, length in ((raw, None), (raw + tail, len(raw))):
        with contextlib.suppress(InvalidArgumentError):
            decode_request(body, length, "m", "")


@pytest.mark.parametrize("size", [0, 5, (1 << 16) + 3, 3 * (1 << 16)])
def test_long_json_outputs_are_written_in_chunks_byte_for_byte(size: int) -> None:
    request = decode_request(b'{"inputs": [], "outputs": [{"name": "B", "parameters": {"binary_data": true}}, {"name": "S"}, {"name": "F"}, {"name": "T"}]}', None, "m", "")
    words = np.empty(size, dtype=object)
    words[:] = [b"w%d" % i for i in range(size)]
    floats = np.arange(size, dtype=np.float32) / 4
    response = InferenceResponse(
        "m", "1",
        [
            Tensor("B", DataType.FP32, (size,), floats),
            Tensor("S", DataType.BYTES, (size,), words),
            Tensor("F", DataType.FP32, (size,), floats),
            Tensor("T", DataType.BYTES, (1,), np.array(["short"], dtype=object)),
        ],
        "id-7",
        {"p": 1},
    )
    body, header_length = encode_response(response, request)
    assert header_length is not None
    header = json.loads(body[:header_length])
    assert [o["name"] for o in header["outputs"]] == ["B", "S", "F", "T"]
    assert header["outputs"][1]["data"] == [w.decode() for w in words]
    assert header["outputs"][2]["data"] == floats.tolist()
    assert header["id"] == "id-7" and header["parameters"] == {"p": 1}
    assert body[header_length:] == floats.tobytes()
    # the same bytes as one orjson call
    outputs = [
        {"name": "B", "datatype": "FP32", "shape": [size], "parameters": {"binary_data_size": 4 * size}},
        {"name": "S", "datatype": "BYTES", "shape": [size], "data": [w.decode() for w in words]},
        {"name": "F", "datatype": "FP32", "shape": [size], "data": floats},
        {"name": "T", "datatype": "BYTES", "shape": [1], "data": ["short"]},
    ]
    whole = {"model_name": "m", "model_version": "1", "id": "id-7", "parameters": {"p": 1}, "outputs": outputs}
    assert body[:header_length] == orjson.dumps(whole, option=orjson.OPT_SERIALIZE_NUMPY)


def test_costs_send_only_long_work_off_the_event_loop() -> None:
    from quiver.frontends.offload import OFFLOAD_NS

    def binary(datatype: str, data: bytes, escape: bool = False) -> tuple[bytes, int]:
        name = "\\u0042YTES" if escape else datatype
        tensor = {"name": "X", "datatype": "NAME", "shape": [1], "parameters": {"binary_data_size": len(data)}}
        header = json.dumps({"inputs": [tensor]}).replace("NAME", name).encode()
        return header + data, len(header)

    image = bytes(224 * 224 * 3 * 4)  # a binary FP32 image is a view: inline, as before
    assert decode_cost(*binary("FP32", image)) < OFFLOAD_NS
    assert decode_cost(*binary("BYTES", bytes(64 << 10))) >= OFFLOAD_NS
    assert decode_cost(*binary("FP32", bytes(64 << 10), escape=True)) >= OFFLOAD_NS  # could spell BYTES
    small = json.dumps({"inputs": [{"name": "X", "datatype": "INT32", "shape": [16], "data": list(range(16))}]}).encode()
    assert decode_cost(small, None) < OFFLOAD_NS
    large = json.dumps({"inputs": [{"name": "X", "datatype": "INT32", "shape": [20_000], "data": list(range(20_000))}]}).encode()
    assert decode_cost(large, None) >= OFFLOAD_NS

    request = decode_request(b'{"inputs": [], "outputs": [{"name": "Y", "parameters": {"binary_data": true}}]}', None, "m", "")
    image_out = Tensor("Y", DataType.FP32, (224 * 224 * 3,), np.zeros(224 * 224 * 3, np.float32))
    assert encode_cost(InferenceResponse("m", "1", [image_out]), request) < OFFLOAD_NS
    as_json = decode_request(b'{"inputs": []}', None, "m", "")
    assert encode_cost(InferenceResponse("m", "1", [image_out]), as_json) >= OFFLOAD_NS
    few = Tensor("Y", DataType.FP32, (1000,), np.zeros(1000, np.float32))
    assert encode_cost(InferenceResponse("m", "1", [few]), as_json) < OFFLOAD_NS
