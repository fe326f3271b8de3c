"""Requests and responses packed for a frontend worker's link come back as they were sent."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest

from quiver.frontends.link_codec import pack_request, pack_response, unpack_request, unpack_response
from quiver.types import (
    DataType,
    InferenceRequest,
    InferenceResponse,
    Placement,
    RequestedOutput,
    Tensor,
)


def _across(packed: Any) -> Any:
    """As the link carries it: pickled in a frame, unpickled on the other side."""
    return pickle.loads(pickle.dumps(("infer", 1, packed), protocol=pickle.HIGHEST_PROTOCOL))[2]


def _same_tensors(got: list[Tensor], sent: list[Tensor]) -> None:
    assert [(t.name, t.datatype, t.shape, t.parameters) for t in got] == [
        (t.name, t.datatype, t.shape, t.parameters) for t in sent
    ]
    for a, b in zip(got, sent, strict=True):
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data)


TENSORS = [
    Tensor("F", DataType.FP32, (2, 3), np.arange(6, dtype=np.float32).reshape(2, 3)),
    Tensor("B", DataType.BOOL, (4,), np.array([True, False, True, True])),
    Tensor("H", DataType.FP16, (3,), np.array([1.5, -2.0, 0.25], dtype=np.float16), {"note": "x"}),
    Tensor("I", DataType.INT64, (2, 2), np.arange(8, dtype=np.int64).reshape(2, 4)[:, ::2]),  # not contiguous
    Tensor("S", DataType.BYTES, (2,), np.array([b"a\x00b", b""], dtype=np.object_)),
    Tensor("E", DataType.INT32, (0, 4), np.zeros((0, 4), dtype=np.int32)),
    Tensor("BE", DataType.UINT16, (2,), np.array([1, 2], dtype=">u2")),  # byte order kept
]


def test_a_request_comes_back_whole() -> None:
    request = InferenceRequest(
        "m", "3", TENSORS, [RequestedOutput("OUT", {"binary_data": True}), RequestedOutput("P")], "id-7",
        {"priority": 2, "custom": "v"}, raw=True,
    )
    packed = pack_request(request)
    assert isinstance(packed, tuple)
    got = unpack_request(_across(packed))
    assert (got.model_name, got.model_version, got.id, got.parameters, got.raw) == ("m", "3", "id-7", request.parameters, True)
    assert got.outputs == request.outputs
    _same_tensors(got.inputs, TENSORS)


def test_every_output_asked_for_stays_none_and_defaults_stay_defaults() -> None:
    got = unpack_request(_across(pack_request(InferenceRequest("m", "", [TENSORS[0]]))))
    assert got.outputs is None and got.parameters == {} and got.id == "" and got.raw is False
    assert got.trace is None and got.input_placements is None


def test_writable_inputs_stay_writable_and_read_only_stay_read_only() -> None:
    writable = np.arange(4, dtype=np.float32)
    read_only = np.frombuffer(writable.tobytes(), dtype=np.float32)
    request = InferenceRequest("m", "", [Tensor("W", DataType.FP32, (4,), writable), Tensor("R", DataType.FP32, (4,), read_only)])
    got = unpack_request(_across(pack_request(request)))
    assert got.inputs[0].data.flags.writeable
    assert not got.inputs[1].data.flags.writeable


def test_a_request_with_shared_memory_travels_as_the_object() -> None:
    request = InferenceRequest("m", "", [TENSORS[0]], input_placements={"F": Placement("region", 0, 24)})
    packed = pack_request(request)
    assert packed is request
    got = unpack_request(_across(packed))
    assert got.input_placements == {"F": Placement("region", 0, 24)}


@pytest.mark.parametrize("shared", [frozenset(), frozenset({"F"})])
def test_a_response_comes_back_whole(shared: frozenset[str]) -> None:
    response = InferenceResponse("m", "1", TENSORS, "id", {"sequence_end": True}, shared)
    got = unpack_response(_across(pack_response(response)))
    assert (got.model_name, got.model_version, got.id, got.parameters, got.shared_memory_outputs) == (
        "m", "1", "id", {"sequence_end": True}, shared,
    )
    _same_tensors(got.outputs, TENSORS)


def test_an_unpacked_object_passes_through() -> None:
    response = InferenceResponse("m", "1", [])
    assert unpack_response(response) is response
