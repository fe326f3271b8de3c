"""Protobuf <-> Quiver conversions of quiver.protocol.v2_grpc, without a server."""

from __future__ import annotations

import contextlib

import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from quiver.errors import InvalidArgumentError
from quiver.protocol.v2_grpc import (
    CONTENTS_FIELD,
    decode_cost,
    decode_infer_request,
    decode_infer_response,
    encode_cost,
    encode_infer_request,
    encode_infer_response,
    parameters_to_dict,
    set_parameters,
)
from quiver.types import DataType, InferenceRequest, InferenceResponse, RequestedOutput, Tensor


def sample(datatype: DataType) -> np.ndarray:
    if datatype is DataType.BOOL:
        return np.array([[True, False], [False, True]])
    if datatype is DataType.BYTES:
        return np.array([[b"a", b""], ["é".encode(), b"\x00\xff"]], dtype=object)
    if datatype is DataType.BF16:
        return np.array([[1.0, -2.5], [0.0, 3.140625]], dtype=ml_dtypes.bfloat16)
    dtype = datatype.numpy_dtype
    if dtype.kind == "f":
        return np.array([[1.5, -2.25], [0.0, 100.0]], dtype=dtype)
    info = np.iinfo(dtype)
    return np.array([[info.min, 0], [1, info.max]], dtype=dtype)


@pytest.mark.parametrize(
    ("datatype", "raw"),
    [(d, raw) for d in DataType for raw in (True, False) if raw or CONTENTS_FIELD[d] is not None],
    ids=lambda v: v.value if isinstance(v, DataType) else ("raw" if v else "contents"),
)
def test_request_round_trip(datatype: DataType, raw: bool) -> None:
    data = sample(datatype)
    request = InferenceRequest(
        "m",
        "2",
        [Tensor("X", datatype, data.shape, data)],
        outputs=[RequestedOutput("Y", {"classification": 3})],
        id="id-1",
        parameters={"priority": 1, "flag": True, "name": "n", "ratio": 0.5, "big": 1 << 63},
    )
    message = encode_infer_request(request, raw=raw)
    assert bool(message.raw_input_contents) is raw
    decoded = decode_infer_request(service_pb2.ModelInferRequest.FromString(message.SerializeToString()))
    assert (decoded.model_name, decoded.model_version, decoded.id) == ("m", "2", "id-1")
    assert decoded.parameters == request.parameters
    assert decoded.outputs == request.outputs
    tensor = decoded.inputs[0]
    assert tensor.shape == data.shape and tensor.datatype is datatype
    assert tensor.data.dtype == data.dtype
    np.testing.assert_array_equal(tensor.data, data)


@pytest.mark.parametrize("datatype", list(DataType), ids=lambda d: d.value)
def test_response_is_raw_and_tritonclient_reads_it(datatype: DataType) -> None:
    data = sample(datatype)
    response = InferenceResponse("m", "1", [Tensor("Y", datatype, data.shape, data)], id="r")
    message = encode_infer_response(response)
    assert len(message.raw_output_contents) == 1 and not message.outputs[0].HasField("contents")
    got = grpcclient.InferResult(message).as_numpy("Y")
    if datatype is DataType.BF16:
        got = got.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got, data)
    back = decode_infer_response(message)
    np.testing.assert_array_equal(back.outputs[0].data, data)
    assert (back.model_name, back.model_version, back.id) == ("m", "1", "r")


def test_parameters_both_ways() -> None:
    message = service_pb2.ModelInferRequest()
    values = {"b": False, "i": -3, "u": (1 << 64) - 1, "d": 2.5, "s": "x", "np": np.int32(4)}
    set_parameters(message.parameters, values)
    assert message.parameters["u"].WhichOneof("parameter_choice") == "uint64_param"
    assert message.parameters["np"].WhichOneof("parameter_choice") == "int64_param"
    assert parameters_to_dict(message.parameters) == values
    message.parameters["empty"].Clear()
    assert "empty" not in parameters_to_dict(message.parameters)


def test_no_outputs_means_all_outputs() -> None:
    message = service_pb2.ModelInferRequest(model_name="m")
    assert decode_infer_request(message).outputs is None


def test_errors_name_the_tensor() -> None:
    message = service_pb2.ModelInferRequest(model_name="m")
    message.inputs.add(name="A", datatype="INT16", shape=[2]).contents.int_contents.extend([1, -40000])
    with pytest.raises(InvalidArgumentError, match="input 'A': a value is out of range for INT16"):
        decode_infer_request(message)
    message = service_pb2.ModelInferRequest(model_name="m")
    message.inputs.add(name="B", datatype="BF16", shape=[1])
    message.raw_input_contents.append(b"\x00")
    with pytest.raises(InvalidArgumentError, match=r"input 'B': shape \[1\] of BF16 needs 2 bytes"):
        decode_infer_request(message)
    message = service_pb2.ModelInferRequest(model_name="m")
    message.inputs.add(name="C", datatype="BYTES", shape=[2]).contents.bytes_contents.append(b"x")
    with pytest.raises(InvalidArgumentError, match=r"input 'C': shape \[2\] needs 2 elements but contents\.bytes_contents has 1"):
        decode_infer_request(message)


HUGE = 1 << 62


@pytest.mark.parametrize(
    ("datatype", "shape", "raw", "message"),
    [
        ("INT32", [0, HUGE], b"", f"input 'X': shape [0, {HUGE}] is too large"),
        ("INT32", [0, HUGE], None, f"input 'X': shape [0, {HUGE}] is too large"),
        ("BYTES", [HUGE, 0], b"", "is too large"),
        ("BYTES", [HUGE, 0], None, "is too large"),
        ("FP32", [HUGE, HUGE], b"", "its dimensions multiply to more than"),
        ("INT32", [HUGE, HUGE], None, "its dimensions multiply to more than"),
        ("INT32", [1] * 65, b"\0\0\0\0", "input 'X': 'shape' has 65 dimensions, more than the 64 allowed"),
        ("FP16", [1] * 65, None, "has 65 dimensions"),
        ("INT32", [-1, -1], b"\0\0\0\0", "'shape' must be a list of non-negative integers"),
        ("BYTES", [2], None, "needs 2 elements but contents.bytes_contents has 0"),
    ],
)
def test_shape_limits(datatype: str, shape: list[int], raw: bytes | None, message: str) -> None:
    request = service_pb2.ModelInferRequest(model_name="m")
    request.inputs.add(name="X", datatype=datatype, shape=shape)
    if raw is not None:
        request.raw_input_contents.append(raw)
    with pytest.raises(InvalidArgumentError) as info:
        decode_infer_request(request)
    assert message in info.value.message


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([d.value for d in DataType] + ["FP8"]),
            st.lists(st.one_of(st.integers(-2, 4), st.sampled_from([HUGE, (1 << 63) - 1])), max_size=4),
            st.one_of(st.none(), st.binary(max_size=40)),
            st.lists(st.integers(-(1 << 31), (1 << 31) - 1), max_size=5),
        ),
        max_size=3,
    )
)
def test_any_message_decodes_or_is_a_client_error(inputs: list[tuple[str, list[int], bytes | None, list[int]]]) -> None:
    request = service_pb2.ModelInferRequest(model_name="m")
    for index, (datatype, shape, raw, ints) in enumerate(inputs):
        tensor = request.inputs.add(name=f"I{index}", datatype=datatype, shape=shape)
        if raw is not None:
            request.raw_input_contents.append(raw)
        elif ints:
            tensor.contents.int_contents.extend(ints)
    with contextlib.suppress(InvalidArgumentError):
        decode_infer_request(request)


def test_costs_send_only_long_work_off_the_event_loop() -> None:
    from quiver.frontends.offload import OFFLOAD_NS

    def message(datatype: str, count: int, raw: bool) -> service_pb2.ModelInferRequest:
        request = service_pb2.ModelInferRequest(model_name="m")
        tensor = request.inputs.add(name="X", datatype=datatype, shape=[count])
        if raw:
            request.raw_input_contents.append(bytes(4 * count))
        else:
            tensor.contents.int_contents.extend([0] * count)
        return request

    assert decode_cost(message("FP32", 224 * 224 * 3, raw=True)) < OFFLOAD_NS  # a view
    assert decode_cost(message("BYTES", 4096, raw=True)) >= OFFLOAD_NS
    assert decode_cost(message("INT32", 16, raw=False)) < OFFLOAD_NS
    assert decode_cost(message("INT32", 4096, raw=False)) >= OFFLOAD_NS
    image = Tensor("Y", DataType.FP32, (224 * 224 * 3,), np.zeros(224 * 224 * 3, np.float32))
    assert encode_cost(InferenceResponse("m", "1", [image])) >= OFFLOAD_NS
    words = Tensor("Y", DataType.BYTES, (16,), np.array([b"w"] * 16, dtype=object))
    assert encode_cost(InferenceResponse("m", "1", [words])) < OFFLOAD_NS
